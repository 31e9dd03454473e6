"""The encoder cache's remote tier (docs/remote.md): a producer node serves
its store over NIXL, a consumer node fetches what it misses into a store
of its own, off its scheduler's path. One file per process and per idea:

- :mod:`.producer`: the producer's scheduler side (:class:`.producer.Server`:
  leases, their budgets, the answers), which starts and watches
  :mod:`.serving_process` (the authenticated endpoint, no NIXL) and
  :mod:`.nixl_process` (the agent and a read-only mapping of the store,
  no key);
- :mod:`.consumer`: the consumer's scheduler side
  (:class:`.consumer.RemoteTier`: the store of fetched outputs, and a
  fetching thread that alone touches the network), with :mod:`.peers`
  (one connection per peer, answer times, backoff) and :mod:`.fetcher`,
  the handle on :mod:`.fetch_process` (the consumer's agent and its
  staging buffer, nothing else);
- :mod:`.protocol`: the messages and their checks; :mod:`.keys`: the
  deployment's secret and the keys derived from it; :mod:`.nixl`: NIXL,
  loaded lazily, and the agents' lives; :mod:`.region`: where a served
  tensor lies; :mod:`.net`: which interface an address is on;
  :mod:`.spawn` and :mod:`.child`: how each child process starts.

Importing this package imports neither vLLM, torch, ZeroMQ nor NIXL.
"""
