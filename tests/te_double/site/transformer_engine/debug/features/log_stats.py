"""TEST DOUBLE of TE's ``LogTensorStats`` and ``LogFp8TensorStats`` features, for the statistics
the recipe reads (a name TE offers that the double does not compute is NotImplementedError; a
name TE does not offer is TE's ValueError)."""

import torch
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.logging import enable_logging_at_current_step
from nvdlfw_inspect.registry import Registry, api_method
from transformer_engine.debug.pytorch.debug_state import STATS

#: TE 2.20.2's names (log_tensor_stats.py; log_fp8_tensor_stats.py's supported_stats, plus
#: overflows% under delayed scaling).
TE_TENSOR_STATS = {"min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"}
TE_FP8_STATS = {"underflows%", "scale_inv_min", "scale_inv_max", "mse", "overflows%"}


class _Feature(GenericConfigAPIMapper):
    offered: set = set()
    computed: set = set()

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        run = enable_logging_at_current_step(
            iteration,
            int(config.get("freq", 1)),
            config.get("start_step", 0) or 0,
            config.get("end_step", -1) if config.get("end_step") is not None else -1,
            config.get("start_end_list"),
        )
        return run, None

    def check(self, stats, recipe_name):
        for stat in stats:
            if stat not in self.offered or (stat == "overflows%" and "delayed" not in recipe_name):
                raise ValueError(f"Stat {stat} contains an unsupported stat name: {stat}")
            if stat not in self.computed:
                raise NotImplementedError(f"the TE test double does not compute {stat}")


@Registry.register_feature(namespace="transformer_engine")
class LogTensorStats(_Feature):
    offered, computed = TE_TENSOR_STATS, {"cur_amax", "max", "min"}

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor, **kw):
        self.check(config["stats"], "")
        x = tensor.detach().float()
        parts = {
            "cur_amax": (x.abs().amax(), "max"),
            "max": (x.amax(), "max"),
            "min": (x.amin(), "min"),
        }
        STATS.feed(layer_name, tensor_name, config["stats"], parts, iteration)


@Registry.register_feature(namespace="transformer_engine")
class LogFp8TensorStats(_Feature):
    offered, computed = TE_FP8_STATS, TE_FP8_STATS - {"mse"}

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor, **kw):
        quantized = kw["rowwise_quantized_tensor"]
        self.check(config["stats"], kw["quantizer"])
        x = tensor.detach().float()
        largest = torch.finfo(quantized.dtype).max
        parts = {
            "numel": (torch.tensor(float(x.numel())), "sum"),
            "underflows_num": (
                (x.count_nonzero() - quantized.values.count_nonzero()).float(),
                "sum",
            ),
            "overflows_num": ((x.abs() > largest * quantized.scale_inv).sum().float(), "sum"),
            "scale_inv_min": (quantized.scale_inv.float(), "min"),
            "scale_inv_max": (quantized.scale_inv.float(), "max"),
        }
        STATS.feed(layer_name, tensor_name, config["stats"], parts, iteration)
