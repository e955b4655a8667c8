"""A step's .metadata pickled without pickling its unchanged parts again.

Every later PFS step of a layout has the same Metadata but for its storage_meta (the
step's folder and save id) and, rarely, where its small items sit. Pickling the whole of
it is most of rank 0's CPU in a small model's drain (debugmodel: about 1,400 items,
4-5 ms a step). So each field is pickled on its own, protocol 2, and kept; a step
pickles only what changed and joins the pieces into the object's own opcodes:

    PROTO 2, GLOBAL Metadata, EMPTY_TUPLE, NEWOBJ, EMPTY_DICT, MARK,
    (key, value)..., SETITEMS, BUILD, STOP

which is how pickle writes a dataclass (copyreg.__newobj__, its __dict__ as state).
Each piece keeps its own memo: a piece's BINGETs only name what the same piece PUT
after it began, so a later piece overwriting those slots changes nothing. The result
is plain pickle: DCP's `pickle.load` (and anything else) reads it as the same object.
"""

import copyreg
import pickle

_HEAD = b"\x80\x02"  # PROTO 2
_TAIL = b"u" b"b" b"."  # SETITEMS, BUILD, STOP


def _body(obj) -> bytes:
    """`obj`'s opcodes without PROTO and STOP."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def _state_of(obj) -> dict | None:
    """The state dict pickle would write for `obj`, when it pickles the plain way."""
    r = obj.__reduce_ex__(2)
    plain = (len(r) >= 3 and r[0] is copyreg.__newobj__ and r[1] == (type(obj),)
             and isinstance(r[2], dict) and all(x is None for x in r[3:]))
    return r[2] if plain else None


class MetadataPickle:
    """Pickles one kept Metadata step after step; `changed(name)` drops a field's piece
    when it was mutated in place (a field given a new object is noticed by itself)."""

    def __init__(self) -> None:
        self._pieces: dict[str, tuple[object, bytes]] = {}  # name -> (value pickled, piece)
        self._checked = False
        self._plain = True

    def changed(self, name: str) -> None:
        self._pieces.pop(name, None)

    def dumps(self, metadata) -> bytes:
        state = _state_of(metadata) if self._plain else None
        if state is None:
            self._plain = False
            return pickle.dumps(metadata)
        cls = type(metadata)
        out = [_HEAD, b"c", f"{cls.__module__}\n{cls.__qualname__}\n".encode(), b")" b"\x81" b"}" b"("]
        for name, value in state.items():
            kept = self._pieces.get(name)
            if kept is None or kept[0] is not value:
                kept = (value, _body(name) + _body(value))
                self._pieces[name] = kept
            out.append(kept[1])
        data = b"".join(out) + _TAIL
        if not self._checked:  # once: the joined pickle must read back as the object
            self._checked, self._plain = True, pickle.loads(data) == metadata
            if not self._plain:
                return pickle.dumps(metadata)
        return data
