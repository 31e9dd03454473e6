"""vLLM's encoder-cache connector on pinshm: encoder outputs saved device to
host straight into a shared store's slots, found by key from any process
through the store's shared index, leased while scheduled, and shared by
every engine of a node.

- :mod:`._connector`: ``PinshmECConnector`` and its metadata, on vLLM's
  connector base classes (it imports vLLM; vLLM's factory imports it,
  through :mod:`pinshm.vllm.ec_connector`);
- :mod:`._scheduler`: the engine core's half (lookups, leases);
- :mod:`._worker`: the workers' half (the writer, saves, loads);
- :mod:`._attach`: a reader that follows the store's name;
- :mod:`._config`, :mod:`._meta`: settings and the messages between them;
- :mod:`.remote`: the remote tier (a producer serving its node's store,
  a consumer fetching over NIXL off the scheduler's path, and their
  messages; NIXL is imported only where ``serve`` or ``peers`` is set:
  docs/remote.md).

Importing this package imports neither vLLM nor torch.
"""

from ._config import DEFAULT_STORE, ECSettings, parse_size

__all__ = ["DEFAULT_STORE", "ECSettings", "parse_size"]
