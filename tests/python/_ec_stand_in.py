"""The text of the stand-in for the few vLLM modules the encoder-cache
connector imports (CI has no vLLM), written out by `_ec_vllm.install`. Its
base class keeps the shape of vLLM's ``ECConnectorBase``
(``vllm/distributed/ec_transfer/ec_connector/base.py``)."""

STAND_IN = {
    "vllm/__init__.py": '''
STAND_IN = True


class LLM:
    """The docs' entry (test_docs_snippets.py): makes the encoder-cache
    connector that `ec_transfer_config` names, for the scheduler and for a
    worker, as vLLM would, and refuses a config the connector would not
    take."""

    def __init__(self, model, tensor_parallel_size=1, ec_transfer_config=None, **kwargs):
        import importlib

        from _ec_vllm import config
        from pinshm.vllm.ec._config import ECSettings, unknown_keys
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        import os

        ec = dict(ec_transfer_config or {})
        extra = ec.get("ec_connector_extra_config", {})
        assert not unknown_keys(extra), unknown_keys(extra)
        ECSettings.from_extra(extra)
        # A name of this run's own: never a real deployment's store.
        extra = dict(extra, store=f"pinshm-doc-{os.getpid()}-{extra.get('store', 'ec')}")
        cls = getattr(importlib.import_module(ec["ec_connector_module_path"]), ec["ec_connector"])
        cfg = config(ec.get("ec_role", "ec_both"), extra, model, tensor_parallel_size)
        self.connectors = [cls(cfg, ECConnectorRole.SCHEDULER), cls(cfg, ECConnectorRole.WORKER)]
        for c in reversed(self.connectors):
            c.shutdown()
''',
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/ec_transfer/__init__.py": "",
    "vllm/distributed/ec_transfer/ec_connector/__init__.py": "",
    "vllm/distributed/ec_transfer/ec_connector/base.py": '''
import enum
from abc import ABC, abstractmethod


class ECConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata(ABC):  # noqa: B024
    pass


class ECConnectorWorkerMetadata(ABC):
    @abstractmethod
    def aggregate(self, other): ...


class ECConnectorBase(ABC):
    def __init__(self, vllm_config, role):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._role = role
        if vllm_config.ec_transfer_config is None:
            raise ValueError("ec_transfer_config must be set for ECConnectorBase")
        self._is_producer = vllm_config.ec_transfer_config.is_ec_producer
        self._is_consumer = vllm_config.ec_transfer_config.is_ec_consumer

    @property
    def role(self):
        return self._role

    @property
    def is_producer(self):
        return self._is_producer

    @property
    def is_consumer(self):
        return self._is_consumer

    def shutdown(self):
        return None

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    @abstractmethod
    def start_load_caches(self, encoder_cache, **kwargs): ...

    @abstractmethod
    def save_caches(self, encoder_cache, mm_hash, **kwargs): ...

    def get_finished(self, finished_req_ids):
        return None, None

    def build_connector_worker_meta(self):
        return None

    @abstractmethod
    def has_cache_item(self, identifier): ...

    def ensure_cache_available(self, request, num_computed_tokens):
        return True

    def take_unavailable_requests(self):
        return set()

    def update_state_after_free(self, request, index):
        return

    @abstractmethod
    def update_state_after_alloc(self, request, index): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request):
        return False, None
''',
    "vllm/distributed/parallel_state.py": '''
import os
import types


def get_tensor_model_parallel_rank():
    return int(os.environ.get("STAND_IN_TP_RANK", "0"))


def get_pp_group():
    return types.SimpleNamespace(is_first_rank=True)
''',
}
