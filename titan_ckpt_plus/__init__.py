"""titan_ckpt_plus: two-tier checkpointing for torchtitan.

torchtitan imports this package twice over: as `[job] custom_config_module`
(`titan_ckpt_plus.config`) while parsing the job file, and as `[experimental]
custom_import` inside `Trainer.__init__`. Both happen with torchtitan already
imported, and that is when the plugin installs itself. The CLI and the pure policy
code import this package without torchtitan and must not pull in torch.
"""

import sys

__version__ = "0.1.0"

if "torchtitan" in sys.modules:
    from titan_ckpt_plus.adapters import torchtitan_v022 as _adapter

    _adapter.install()
