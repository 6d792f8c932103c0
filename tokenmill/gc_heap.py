"""Keep Python's cyclic garbage collector off the hot path of a serving process.

A full (generation 2) collection walks every tracked object: in a worker that is the model's modules, parameters and
recorded kernel calls, and such passes took 40-600 ms each while the default model loaded on a 2-vCPU host (a CPU
decode step is ~14 ms), so one landing mid-serving would hold every user's next token for several steps. What a
process builds while it starts lives as long as the process, so it is collected once and then frozen (moved to the
permanent generation the collector never walks), as vLLM's engine core does; later collections see only what serving
allocates.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt everything still alive from future collections."""
    gc.collect()
    gc.freeze()
