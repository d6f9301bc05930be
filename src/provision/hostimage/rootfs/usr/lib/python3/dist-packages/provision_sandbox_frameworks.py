"""Puts the framework layers the sandbox mounted on this host on every python3's path.

provision's sandbox installs TensorFlow or PyTorch once on the controller (pip --target) and
bind-mounts each under /opt/provision-sandbox/frameworks/<name> read-only; the .pth file
beside this module imports it at interpreter start, so `python3 -c "import torch"` works
with no PYTHONPATH. Hosts without a mount get nothing added.
"""

import os
import site

ROOT = "/opt/provision-sandbox/frameworks"

if os.path.isdir(ROOT):
    for _name in sorted(os.listdir(ROOT)):
        site.addsitedir(os.path.join(ROOT, _name))
