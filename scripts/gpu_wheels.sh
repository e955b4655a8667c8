#!/usr/bin/env bash
# Fill .whl/ with the wheels scripts/gpu_check.sh installs on the device machine: the
# packages its image lacks (Python 3.12 with torch 2.11.0+cu130 and, among others,
# numpy, pyarrow, pandas, fsspec, huggingface-hub, tokenizers, tensorboard, einops,
# pillow, xxhash: the device tool's KINDS.md). torchtitan 0.2.2 and what it and the
# plugin import; typing-extensions only because typeguard needs >= 4.14 and the
# image's version is not listed. Run here (it needs the package registry), never there;
# .whl/ is ignored through .git/info/exclude and travels only when `carry` names it.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 \
  typeguard==4.6.1 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  crc32c==2.9.post0
ls -l .whl
