"""Patch of ``vllm.engine.arg_utils.EngineArgs`` (process 0): accept our method names in ``speculative_config``, and
check the method's options against the served model there (a head for another model is refused with our message,
not as a worker's start-up failure)."""

from __future__ import annotations

from typing import Callable

from vllm.engine.arg_utils import EngineArgs

from vllm_treespec.patches import is_patched, wrap_method


def apply(activate_tree_mode: Callable[[], None]) -> None:
    """``activate_tree_mode`` (the plugin's) runs once a config names a tree method."""
    if is_patched(EngineArgs, "create_speculative_config"):
        return

    @wrap_method(EngineArgs, "create_speculative_config",
                 ("self", "target_model_config", "target_parallel_config"))
    def create_speculative_config(original, self, target_model_config, target_parallel_config):
        from vllm_treespec import config

        spec, extra, is_tree = config.translate(self.speculative_config, self.additional_config, target_model_config)
        if is_tree:
            config.check_parallelism(target_parallel_config)
            self.speculative_config, self.additional_config = spec, extra
            activate_tree_mode()
        return original(self, target_model_config, target_parallel_config)
