"""torch_memory_saver served by deferalloc (docs/RL.md): put this directory's parent first on
PYTHONPATH (``deferalloc.memory_saver.shim_path()``) and ``from torch_memory_saver import
torch_memory_saver`` gives deferalloc.memory_saver's singleton, unchanged code included."""
import sys

from deferalloc import memory_saver as _memory_saver

# The module itself, so that its attributes (the singleton, TorchMemorySaver,
# configure_subprocess) are the drop-in's and not copies.
sys.modules[__name__] = _memory_saver
