"""What every engine's adapter on a node shares, below them all
(``pinshm.vllm`` and ``pinshm.sglang`` import it; it imports neither):

- :mod:`.budget`: one budget for the node's /dev/shm (vLLM's own
  segments, queues, overflow stores, caches), the kernel's free count as
  the shared ledger;
- :mod:`.tracker` and :mod:`.reaper`: a process's segments removed after
  it dies, SIGKILL included (a detached reaper per process);
- :mod:`.numa`: which NUMA node a mapping's pages and a GPU sit on.

Typed views of segments (``pinshm.segments``) and the core classes
(``pinshm._pinshm``) sit below this room too."""
