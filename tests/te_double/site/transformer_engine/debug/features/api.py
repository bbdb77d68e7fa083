"""TEST DOUBLE of TE's ``debug/features/api.py``: the ``transformer_engine`` namespace of
nvdlfw-inspect's API, routed as TE routes it (by tensor name; several features may inspect the
same tensor), logging the step's statistics at ``debug_api.step()``."""

from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry
from transformer_engine.debug.pytorch.debug_state import STATS, TEDebugState

_MULTIPLE = {"inspect_tensor", "inspect_tensor_enabled"}


class _Defaults:
    """What an API answers for a layer no feature selects (TE's TEDefaultFeatures)."""

    def inspect_tensor_enabled(self, config, layer_name, **kwargs):
        return False, None

    def inspect_tensor(self, config, layer_name, **kwargs):
        return None


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineAPI(BaseNamespaceAPI):
    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = _Defaults()
        self._cacheable_api_kwargs_map = {"inspect_tensor_enabled": ["tensor_name"]}

    def input_assertions_hook(self, api_name, **kwargs):
        assert "tensor_name" in kwargs, f"Provide tensor_name in {api_name}."

    def routing_condition(self, api_name, config, _, feature_obj, **kwargs):
        return feature_obj.parse_config_and_api(config, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        if api_name == "inspect_tensor":
            assert ret is None

    def is_multiple_feature_invocation_allowed(self, api_name):
        return api_name in _MULTIPLE

    def handle_multi_feature_output(self, api_name, outputs, features, **kwargs):
        if api_name == "inspect_tensor_enabled":
            return any(run for run, _ in outputs), None
        return None

    def step(self):
        STATS.log()

    def end_debug(self):
        TEDebugState._reset()
