"""One lock around weight loading in a process.

diffusers' and transformers' ``from_pretrained`` build modules on the meta device by switching
torch's parameter registration for the whole process while they load (accelerate's
``init_empty_weights``). Two stages placed ``inline`` load in two threads of one process, so one
load's modules could be built on the other's meta device ("Cannot copy out of meta tensor").
The same holds for diffusers' lazy top-level imports (``from diffusers import ModularPipeline``
in two threads at once fails with an ImportError). Loads of this plugin's parts take turns;
stages in separate processes are unaffected.
"""

from __future__ import annotations

import threading

LOAD_LOCK = threading.RLock()  # re-entrant: a part may load another piece while holding it
