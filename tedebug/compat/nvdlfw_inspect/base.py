"""``nvdlfw_inspect.base``: `BaseNamespaceAPI` (the contract of a custom namespace) and `BaseConfigAPIMapper`.

A custom namespace's API class derives from `BaseNamespaceAPI`, implements the four abstract hooks and may set, in
``__init__`` after calling ``super().__init__()``:

- ``_default_api_impl``: an object whose public methods answer an API that no feature serves, called as
  ``method(config={}, layer_name, **kwargs)``;
- ``_cacheable_api_kwargs_map``: API name -> the kwarg names whose values key the routing cache (an API not listed
  is routed on every call).

`tedebug.namespace.CustomNamespace` runs nvdlfw-inspect's routing (input check, cached feature choice, default
implementation, output check, combination of several features' answers) with these hooks.
"""

from __future__ import annotations

import abc
import copy
from typing import Any, Optional

import torch

from tedebug.config.parsing import parse_feature_config

__all__ = ["BaseConfigAPIMapper", "BaseNamespaceAPI"]


def outputs_equal(a: Any, b: Any) -> bool:
    """Equality that also compares tensors (by value) inside dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(outputs_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(outputs_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


class BaseNamespaceAPI(abc.ABC):
    """Base class of a custom namespace's API (see the module docstring)."""

    def __init__(self) -> None:
        self._default_api_impl: Any = None
        self._cacheable_api_kwargs_map: dict = {}

    @abc.abstractmethod
    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        """Check the kwargs of a call (raise on bad input)."""

    @abc.abstractmethod
    def routing_condition(
        self, api_name: str, config: dict, layer_name: str, feature_obj: Any, **kwargs: Any
    ) -> "tuple[bool, Optional[dict]]":
        """``(applies, modified config or None)`` for one enabled feature; usually
        ``feature_obj.parse_config_and_api(config, gemm_parsing=..., tensor_parsing=..., **kwargs)``."""

    @abc.abstractmethod
    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        """Check the result of one feature call."""

    @abc.abstractmethod
    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        """Whether several features may serve one call of `api_name`."""

    def call_feature(self, call, feat_config: dict, layer_name: str, **kwargs: Any) -> Any:
        """Call one feature method (override to adapt the kwargs)."""
        return call(feat_config, layer_name, **kwargs)

    def handle_multi_feature_output(self, api_name: str, outputs: list, features_to_invoke: list, **kwargs: Any) -> Any:
        """Combine the results of several features; by default they must all be equal."""
        first = outputs[0]
        if not all(outputs_equal(first, other) for other in outputs[1:]):
            raise AssertionError(
                f"Different Outputs when invoking multiple features per API call is not allowed "
                f"(API {api_name!r}, features {list(features_to_invoke)}): override "
                f"handle_multi_feature_output to combine them"
            )
        return first

    def step(self) -> None:
        """Called by ``debug_api.step()`` after the iteration counter advanced."""

    def end_debug(self) -> None:
        """Called by ``debug_api.end_debug()``."""


class BaseConfigAPIMapper(abc.ABC):
    """Base class of feature config parsers (``parse_config_and_api``), with nvdlfw's tensor-level parsing."""

    @abc.abstractmethod
    def parse_config_and_api(self, config: dict, **kwargs: Any) -> "tuple[bool, Optional[dict]]":
        """``(applies, parsed config or None)``."""

    def _process_tensor_config(self, config: dict, tensor_name: Optional[str]) -> Optional[dict]:
        """nvdlfw-inspect's tensor parsing: ``tensors_struct`` (first entry whose ``tensor`` matches, its keys over
        the outer ones) before ``tensors``; the result has ``tensor: <name>`` and no list key; None when the tensor
        is not listed; ValueError when neither key is given.  ``enabled`` is kept (callers drop it)."""
        parsed = parse_feature_config(config, tensor_name=tensor_name, gemm_parsing=False, tensor_parsing=True)
        if parsed is not None and "enabled" in config and "enabled" not in parsed:
            parsed = {"enabled": copy.deepcopy(config["enabled"]), **parsed}
        return parsed
