"""The module vLLM loads the encoder-cache connector from:
``"ec_connector_module_path": "pinshm.vllm.ec_connector"`` with
``"ec_connector": "PinshmECConnector"``. It imports vLLM: nothing in the
package imports it (see :mod:`pinshm.vllm.ec._connector`, its one implementation; this is its one public name)."""

from .ec._connector import PinshmECConnector, PinshmECConnectorMetadata, PinshmECWorkerMetadata

__all__ = ["PinshmECConnector", "PinshmECConnectorMetadata", "PinshmECWorkerMetadata"]
