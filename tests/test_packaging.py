"""The plugin installs into a user's own torchtitan environment: its requirements are
ranges (the exact pins of the demo and CI live in constraints.txt), its wheel builds,
and installing that wheel where torch and torchtitan already are leaves them alone."""

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from harness import ROOT


def _requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_requirements_are_ranges_that_admit_the_users_torch():
    reqs = _requirements()
    assert not [r for r in reqs.values() if any(s.operator in ("==", "===") for s in r.specifier)]
    torch, titan = reqs["torch"].specifier, reqs["torchtitan"].specifier
    for v in ("2.11.0+cu130", "2.12.1+cu128", "2.13.0+cpu"):  # GPU machines here carry 2.11
        assert torch.contains(v, prereleases=False), v
    assert not torch.contains("2.10.0") and not torch.contains("2.14.0")  # older than the adapter, untested
    assert titan.contains("0.2.2") and not titan.contains("0.3.0") and not titan.contains("0.2.1")


def test_the_exact_pins_live_in_the_constraints_file_that_setup_applies():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    assert pins["torch"].startswith("2.13.0") and pins["torchtitan"] == "0.2.2"
    for name, req in _requirements().items():
        if req.marker is None or req.marker.evaluate():
            assert req.specifier.contains(pins[name.lower()], prereleases=True), (name, pins.get(name))
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()


def _existing_env(folder: Path) -> Path:
    """This venv's packages but the plugin (links to them): a torchtitan environment
    the plugin is not yet installed in."""
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "titan_ckpt_plus" not in entry.name:
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.e2e
def test_wheel_installs_into_an_existing_environment_and_leaves_torch_alone(tmp_path):
    """`pip wheel .`, then an offline install into a fresh venv that sees this venv's
    packages (standing in for a cluster's torchtitan environment): pip must find every
    requirement satisfied and install nothing but the plugin."""
    run = lambda *cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "-w", str(tmp_path / "dist"), str(ROOT))
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("titan_ckpt_plus-*.whl")
    venv = tmp_path / "user-env"
    assert run(sys.executable, "-m", "venv", "--without-pip", str(venv)).returncode == 0
    py = venv / "bin" / "python"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "existing-env.pth").write_text(f"{_existing_env(tmp_path / 'existing')}\n")
    torch_before = run(py, "-c", "import torch, torchtitan, os; print(torch.__version__, "
                                 "os.path.dirname(torch.__file__))").stdout
    assert torch_before.startswith("2.13.0"), torch_before
    inst = run(py, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", str(wheel))
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert "Installing collected packages: titan-ckpt-plus\n" in inst.stdout  # nothing else
    installed = sorted(p.name.split("-")[0] for p in site.iterdir() if p.suffix in (".dist-info",))
    assert installed == ["titan_ckpt_plus"], installed  # nothing else was installed or replaced
    after = run(py, "-c", "import torch, torchtitan, os; print(torch.__version__, "
                          "os.path.dirname(torch.__file__))").stdout
    assert after == torch_before
    cli = run(venv / "bin" / "titan-ckpt", "plan", "--delta", "10", "--mtbf-hours", "3")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert os.path.isdir(site / "titan_ckpt_plus")
