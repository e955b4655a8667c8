"""Dataloader resumption by global sample count (issue 5).

    token_index    tokenize a local dataset once into a memory-mapped token file + index
    global_stream  sequence i of the one global stream (independent of the DP degree)
    loader         the torchtitan-compatible, Stateful dataloader over that stream
    dcp_hint       lets the loader read torchtitan's per-rank checkpoints as well

None of these import torchtitan; adapters/torchtitan_v022_data.py wires them in.
"""
