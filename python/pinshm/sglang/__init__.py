"""pinshm for SGLang: the multimodal features SGLang's tokenizer sends its
scheduler ranks, through one pinshm store instead of a new /dev/shm
segment per feature per request.

SGLang (0.5.23) wraps each CPU feature tensor in ``ShmPointerMMData``,
which creates ``sgl_shm_mm_<pid>_<rand>``, copies the tensor in, and
sends its name; every rank maps it, and the first to finish unlinks it.
The plugin (entry point ``pinshm`` of group ``sglang.srt.plugins``, loaded
by SGLang in its launcher, scheduler, detokenizer and DP-controller
processes) replaces that class with one of the same name whose objects
live in a cache store the tokenizer process writes:

- a feature is put once, keyed by SGLang's item hash; the same image sent
  again is served from the store (``get_cached``), never copied again;
- what travels is the name SGLang's pickle and msgpack hops already carry
  (``pinshm:STORE:ADDRESS:ID:EPOCH``), so ``has_shm_features``,
  ``unwrap_shm_features`` and ``discard_shm_features`` work unchanged;
- each rank reads the slot in place and ``materialize()`` returns a
  private tensor; the slot is held while it is copied, and the tokenizer
  leases each object it sends for ``PINSHM_SGLANG_GRACE_S`` seconds (300),
  so a rank's read never meets a reused slot, and nothing is owed by
  ranks that never read (DP, PD): nothing is pinned for ever;
- a full store or /dev/shm makes the put raise ``OSError``, which SGLang
  answers with its inline path (one warning); a SIGKILLed tokenizer's
  store is removed by its reaper.

``PINSHM_SGLANG=0`` leaves SGLang's own path. The plugin binds only the
SGLang versions whose internals it was checked against (``_fit.TESTED``);
elsewhere it logs one WARNING and leaves SGLang's path in place.
"""

from __future__ import annotations

__all__: list[str] = []
