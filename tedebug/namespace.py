"""Hook dispatch: the `transformer_engine` namespace (seven hooks) and the section-level `base` namespace.

A hook call ``debug_api.transformer_engine.<hook>(layer_name, **kwargs)``:

1. checks the kwargs: unknown names raise TypeError naming the closest valid kwarg; a missing required kwarg (the
   `required` kwargs of the hook in `HOOKS`) raises TypeError naming it; ``iteration`` defaults to the session's
   iteration;
2. routes: the candidates are the features of the layer's ``transformer_engine`` block that implement the hook and
   are enabled; each candidate's ``parse_config_and_api`` decides whether it applies and produces its parsed config.
   The decision (a tuple of (feature, bound method, parsed config)) is cached per (layer, hook, gemm, tensor_name)
   for every hook, `fp8_gemm_enabled` and multi-feature results included; the cache never depends on the iteration.
   The feature methods themselves run on every hook call; `routes` gives a key's decision to callers that compile
   it (`tedebug.plan`, which answers keys no feature serves, or only schedule-only features serve, itself);
3. no feature -> the default result (`fp8_gemm_enabled` (True, None); `*_enabled` (False, None); `inspect_*` None;
   `modify_tensor` raises NotImplementedError); one feature -> its result; several -> allowed only for the
   multi-feature hooks, combined as TransformerEngine combines them (`*_enabled`: all tuples -> (any, min of
   non-None next); any bare bool -> (any, None); `inspect_*`: all results equal).  Two features on a single-feature
   hook raise ValueError "Only 1 operation permitted per API call" naming both features, the layer, the hook and
   the kwargs.
4. output checks: `*_enabled` must return a bool or a (bool, next_iteration) tuple; `inspect_*` must return None;
   `modify_tensor` must return a torch.Tensor or a QuantizedTensor (of ``dtype`` when that kwarg is given) or, when
   ``out`` is given, may return None after filling ``out`` (TE's check rejects that documented None; we accept it).

Backward compatibility: for `inspect_tensor` the kwargs ``quantizer``, ``rowwise_quantized_tensor``,
``columnwise_quantized_tensor`` and ``tp_size`` (for `inspect_tensor_postquantize`: ``tp_size``) are dropped when the
feature method declares neither them nor ``**kwargs``.  Calling a feature's `inspect_tensor_postquantize*` emits a
DeprecationWarning.

The `base` namespace routes the APIs implemented by section-level (namespace ``base``) features, e.g. nvdlfw's
``debug_api.log_tensor_stats(layer, tensor=, tensor_name=)`` served by the built-in generic ``LogTensorStats``
(`tedebug.compat.nvdlfw_inspect.debug_features.log_tensor_stats`, replaceable by a feature file).

Custom namespaces (`CustomNamespace`, at the end of this module) route ``debug_api.<namespace>.<api>(...)`` with the
hooks of a namespace API class registered by a feature file (nvdlfw-inspect's `BaseNamespaceAPI` contract).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import torch

from tedebug.config.errors import closest
from tedebug.config.parsing import GEMM_NAMES, TENSOR_NAMES

TE_NAMESPACE = "transformer_engine"
BASE_NAMESPACE = "base"
INSPECT_LEGACY_KWARGS = frozenset({"quantizer", "rowwise_quantized_tensor", "columnwise_quantized_tensor", "tp_size"})
POSTQUANTIZE_LEGACY_KWARGS = frozenset({"tp_size"})


# ------------------------------------------------------------------------------------------------- hook table
def _enabled_default(value: bool) -> Callable:
    def default(layer_name: str, kwargs: dict):
        return (value, None)

    return default


def _none_default(layer_name: str, kwargs: dict):
    return None


def _modify_default(layer_name: str, kwargs: dict):
    raise NotImplementedError(
        f"modify_tensor was called for layer {layer_name!r} (tensor_name={kwargs.get('tensor_name')!r}, "
        f"gemm={kwargs.get('gemm')!r}) but no enabled feature implements it there; call it only when "
        f"modify_tensor_enabled returned True"
    )


@dataclass(frozen=True)
class HookSpec:
    """Static description of one hook: its kwargs, its default answer, whether several features may serve it."""

    name: str
    required: Tuple[str, ...]
    optional: Tuple[str, ...]
    multi: bool
    kind: str  # "enabled", "inspect" or "modify"
    default: Callable[[str, dict], Any]
    legacy_kwargs: FrozenSet[str] = frozenset()
    deprecated: bool = False

    @property
    def allowed(self) -> FrozenSet[str]:
        return frozenset(self.required) | frozenset(self.optional)

    @property
    def gemm_parsing(self) -> bool:
        return "gemm" in self.required

    @property
    def tensor_parsing(self) -> bool:
        return "tensor_name" in self.required


HOOKS: Dict[str, HookSpec] = {
    spec.name: spec
    for spec in (
        HookSpec("fp8_gemm_enabled", ("gemm",), ("iteration",), True, "enabled", _enabled_default(True)),
        HookSpec(
            "modify_tensor_enabled", ("tensor_name", "gemm"), ("iteration",), False, "enabled", _enabled_default(False)
        ),
        HookSpec(
            "modify_tensor",
            ("tensor_name", "gemm"),
            ("tensor", "default_quantizer", "iteration", "dtype", "out"),
            False,
            "modify",
            _modify_default,
        ),
        HookSpec("inspect_tensor_enabled", ("tensor_name",), ("iteration",), True, "enabled", _enabled_default(False)),
        HookSpec(
            "inspect_tensor",
            ("tensor_name",),
            (
                "tensor",
                "iteration",
                "tp_group",
                "tp_size",
                "rowwise_quantized_tensor",
                "columnwise_quantized_tensor",
                "quantizer",
            ),
            True,
            "inspect",
            _none_default,
            legacy_kwargs=INSPECT_LEGACY_KWARGS,
        ),
        HookSpec(
            "inspect_tensor_postquantize_enabled",
            ("tensor_name",),
            ("gemm", "iteration"),
            True,
            "enabled",
            _enabled_default(False),
            deprecated=True,
        ),
        HookSpec(
            "inspect_tensor_postquantize",
            ("tensor_name",),
            ("tensor", "iteration", "tp_group", "tp_size", "rowwise"),
            True,
            "inspect",
            _none_default,
            legacy_kwargs=POSTQUANTIZE_LEGACY_KWARGS,
            deprecated=True,
        ),
    )
}


#: hook name -> the kwargs it accepts (HookSpec.allowed, built once)
ALLOWED_KWARGS: Dict[str, FrozenSet[str]] = {name: spec.allowed for name, spec in HOOKS.items()}


# ------------------------------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Route:
    """One routed feature: its name, the bound hook method, the parsed config and the kwargs it does not accept."""

    feature: str
    method: Callable
    config: dict
    drop: FrozenSet[str] = frozenset()


def kwargs_to_drop(method: Callable, legacy: FrozenSet[str]) -> FrozenSet[str]:
    """The legacy kwargs that `method` accepts neither by name nor through ``**kwargs``."""
    if not legacy:
        return frozenset()
    params = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset()
    return frozenset(k for k in legacy if k not in params)


def check_kwargs(hook: str, layer_name: str, kwargs: dict, allowed: FrozenSet[str], required: Tuple[str, ...]) -> None:
    """TypeError for an unknown kwarg (naming the closest valid one) or a missing required kwarg."""
    if not kwargs.keys() <= allowed:
        unknown = kwargs.keys() - allowed
        name = sorted(unknown)[0]
        hint = closest(name, allowed)
        hint_text = f"; did you mean {hint!r}?" if hint else ""
        raise TypeError(
            f"{hook}(layer_name={layer_name!r}) got an unexpected keyword argument {name!r}{hint_text} "
            f"(valid: {', '.join(sorted(allowed))})"
        )
    for name in required:
        if kwargs.get(name) is None:
            raise TypeError(
                f"{hook}(layer_name={layer_name!r}) needs the keyword argument {name!r} to route the call "
                f"(required: {', '.join(required)})"
            )


def check_routing_values(hook: str, layer_name: str, kwargs: dict) -> None:
    """ValueError for a gemm / tensor_name that is not one of the known names (checked once per cache entry)."""
    for key, valid in (("gemm", GEMM_NAMES), ("tensor_name", TENSOR_NAMES)):
        value = kwargs.get(key)
        if value is not None and value not in valid:
            hint = closest(value, valid)
            hint_text = f"; did you mean {hint!r}?" if hint else ""
            raise ValueError(
                f"{hook}(layer_name={layer_name!r}): unknown {key} {value!r}{hint_text} "
                f"(expected one of {', '.join(valid)})"
            )


def combine_enabled(outputs) -> Tuple[bool, Optional[int]]:
    """Several `*_enabled` answers as one: all tuples -> (any, min non-None next or None); any bare bool -> (any,
    None)."""
    if all(isinstance(o, tuple) for o in outputs):
        nexts = [o[1] for o in outputs if o[1] is not None]
        return any(bool(o[0]) for o in outputs), (min(nexts) if nexts else None)
    return any(bool(o[0]) if isinstance(o, tuple) else bool(o) for o in outputs), None


def _is_quantized_tensor(value: Any) -> bool:
    from tedebug.quantization.tensor import QuantizedTensor

    return isinstance(value, QuantizedTensor)


def _where(spec: HookSpec, feature: str, layer_name: str) -> str:
    return f"feature {feature!r}, hook {spec.name!r}, layer {layer_name!r}"


def check_output(spec: HookSpec, feature: str, layer_name: str, kwargs: dict, result: Any) -> None:
    """Check a feature's answer against the hook's contract (see the module docstring, step 4); unlike TE, a
    ``modify_tensor(out=...)`` that filled ``out`` may return None."""
    kind = spec.kind
    if kind == "inspect":
        if result is not None:
            raise TypeError(
                f"{_where(spec, feature, layer_name)}: inspect hooks must return None, got {type(result).__name__}"
            )
        return
    if kind == "enabled":
        ok = isinstance(result, bool) or (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], bool)
            and (result[1] is None or isinstance(result[1], int))
        )
        if not ok:
            raise TypeError(
                f"{_where(spec, feature, layer_name)}: must return a bool or a "
                f"(bool, next_iteration_or_None) tuple, got {result!r}"
            )
    else:  # modify
        where = _where(spec, feature, layer_name)
        if result is None:
            if kwargs.get("out") is None:
                raise TypeError(f"{where}: returned None without an `out` tensor to fill; return the new tensor")
            return
        if isinstance(result, torch.Tensor):
            dtype = kwargs.get("dtype")
            if dtype is not None and result.dtype != dtype:
                raise ValueError(f"{where}: returned a tensor of dtype {result.dtype}, expected dtype={dtype}")
        elif not _is_quantized_tensor(result):
            raise TypeError(f"{where}: must return a torch.Tensor or a QuantizedTensor, got {type(result).__name__}")


class _Dispatcher:
    """Routing shared by the namespaces: layer config lookup, candidate selection, cache, invocation."""

    name = ""

    def __init__(self, session: Any):
        self._session = session
        self._routes: Dict[tuple, Tuple[Route, ...]] = {}

    @property
    def cache_size(self) -> int:
        return len(self._routes)

    def _decide(
        self,
        hook: str,
        layer_name: str,
        kwargs: dict,
        *,
        multi: bool,
        gemm_parsing: bool,
        tensor_parsing: bool,
        legacy: FrozenSet[str],
    ) -> Tuple[Route, ...]:
        block = self._session.config.layer_config(layer_name).get(self.name) or {}
        registry = self._session.registry
        routing = {k: kwargs[k] for k in ("gemm", "tensor_name") if kwargs.get(k) is not None}
        routes = []
        for feature, feature_cfg in block.items():
            info = registry.get(self.name, feature)
            if info is None:  # the loader rejects unregistered names; kept as a guard
                continue
            if hook not in info.hooks or not feature_cfg:
                continue
            if "enabled" not in feature_cfg:
                raise ValueError(
                    f"layer {layer_name!r}: missing required config field 'enabled' under {self.name}.{feature}"
                )
            if not feature_cfg["enabled"]:
                continue
            instance = info.instance()
            applies, parsed = instance.parse_config_and_api(
                feature_cfg, gemm_parsing=gemm_parsing, tensor_parsing=tensor_parsing, **routing
            )
            if applies:
                method = getattr(instance, hook)
                routes.append(
                    Route(feature, method, feature_cfg if parsed is None else parsed, kwargs_to_drop(method, legacy))
                )
        if len(routes) > 1 and not multi:
            names = ", ".join(r.feature for r in routes)
            raise ValueError(
                f"Only 1 operation permitted per API call. Found {len(routes)} features ({names}) enabled for hook "
                f"{hook!r} on layer {layer_name!r} with kwargs {routing}"
            )
        for route in routes:
            self._session.log_message(
                f"Debug API call '{hook}' ({routing}) routed to feature '{route.feature}'.", layer_name, logging.DEBUG
            )
        return tuple(routes)

    @staticmethod
    def _invoke(route: Route, hook: str, layer_name: str, kwargs: dict, deprecated: bool) -> Any:
        if deprecated:
            warnings.warn(
                f"{hook} is deprecated (feature {route.feature!r}); use inspect_tensor, which receives "
                f"the quantized tensors",
                DeprecationWarning,
                stacklevel=4,
            )
        if route.drop:
            kwargs = {k: v for k, v in kwargs.items() if k not in route.drop}
        return route.method(route.config, layer_name, **kwargs)

    def step(self, finished_iteration: int) -> None:
        """Called by `debug_api.step()` after the iteration counter moved on."""

    def end_debug(self) -> None:
        """Called by `debug_api.end_debug()`: drop the routing cache."""
        self._routes.clear()


class TransformerEngineNamespace(_Dispatcher):
    """``debug_api.transformer_engine``: the seven hooks of `HOOKS` (see the module docstring)."""

    name = TE_NAMESPACE

    def __init__(self, session: Any):
        super().__init__(session)
        #: tables derived from this namespace's routing by its callers (`tedebug.plan`'s compiled plans): dropped
        #: at `end_debug()` and whenever a hook is overridden on (or removed from) this instance
        self.compiled: Dict[str, Any] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if name in HOOKS:
            self.compiled.clear()  # an override must be called: nothing compiled may answer for it
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in HOOKS:
            self.compiled.clear()
        object.__delattr__(self, name)

    def overridden(self, hook: str) -> bool:
        """True when `hook` is overridden on this instance (an override is always called)."""
        return hook in self.__dict__

    def routes(
        self, hook: str, layer_name: str, gemm: Optional[str] = None, tensor_name: Optional[str] = None
    ) -> Tuple[Route, ...]:
        """The features serving `hook` for this routing key (empty: the hook's default answers), routing the key
        now (with the checks of a call: names, required routing kwargs) when it is new.  Routing is fixed for the
        session, so callers may keep what they derive from it (`tedebug.plan`)."""
        key = (layer_name, hook, gemm, tensor_name)
        routes = self._routes.get(key)
        if routes is None:
            spec = HOOKS[hook]
            kwargs = {k: v for k, v in (("gemm", gemm), ("tensor_name", tensor_name)) if v is not None}
            check_kwargs(hook, layer_name, kwargs, ALLOWED_KWARGS[hook], spec.required)
            check_routing_values(hook, layer_name, kwargs)
            routes = self._decide(
                hook,
                layer_name,
                kwargs,
                multi=spec.multi,
                gemm_parsing=spec.gemm_parsing,
                tensor_parsing=spec.tensor_parsing,
                legacy=spec.legacy_kwargs,
            )
            self._routes[key] = routes
        return routes

    def _call(self, hook: str, layer_name: str, kwargs: dict) -> Any:
        spec = HOOKS[hook]
        check_kwargs(hook, layer_name, kwargs, ALLOWED_KWARGS[hook], spec.required)
        if "iteration" not in kwargs:
            kwargs["iteration"] = self._session.iteration
        gemm, tensor_name = kwargs.get("gemm"), kwargs.get("tensor_name")
        routes = self._routes.get((layer_name, hook, gemm, tensor_name))
        if routes is None:
            routes = self.routes(hook, layer_name, gemm, tensor_name)
        if not routes:
            return spec.default(layer_name, kwargs)
        if len(routes) == 1:
            route = routes[0]
            result = self._invoke(route, hook, layer_name, kwargs, spec.deprecated)
            check_output(spec, route.feature, layer_name, kwargs, result)
            return result
        outputs = []
        for route in routes:
            result = self._invoke(route, hook, layer_name, kwargs, spec.deprecated)
            check_output(spec, route.feature, layer_name, kwargs, result)
            outputs.append(result)
        if len(outputs) == 1:
            return outputs[0]
        if spec.kind == "enabled":
            return combine_enabled(outputs)
        return outputs[0]  # inspect hooks: every output was checked to be None

    # The hooks (layer_name positional or keyword; everything else keyword-only).
    def fp8_gemm_enabled(self, layer_name: str, **kwargs: Any):
        return self._call("fp8_gemm_enabled", layer_name, kwargs)

    def modify_tensor_enabled(self, layer_name: str, **kwargs: Any):
        return self._call("modify_tensor_enabled", layer_name, kwargs)

    def modify_tensor(self, layer_name: str, **kwargs: Any):
        return self._call("modify_tensor", layer_name, kwargs)

    def inspect_tensor_enabled(self, layer_name: str, **kwargs: Any):
        return self._call("inspect_tensor_enabled", layer_name, kwargs)

    def inspect_tensor(self, layer_name: str, **kwargs: Any):
        return self._call("inspect_tensor", layer_name, kwargs)

    def inspect_tensor_postquantize_enabled(self, layer_name: str, **kwargs: Any):
        return self._call("inspect_tensor_postquantize_enabled", layer_name, kwargs)

    def inspect_tensor_postquantize(self, layer_name: str, **kwargs: Any):
        return self._call("inspect_tensor_postquantize", layer_name, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        hint = closest(name, HOOKS)
        hint_text = f"; did you mean {hint!r}?" if hint else ""
        raise AttributeError(
            f"namespace 'transformer_engine' has no hook {name!r}{hint_text} (hooks: {', '.join(HOOKS)})"
        )

    def step(self, finished_iteration: int) -> None:
        self._session.stats.step(finished_iteration)

    def end_debug(self) -> None:
        super().end_debug()
        self.compiled.clear()
        self._session.stats.reset()


class BaseNamespace(_Dispatcher):
    """Section-level (namespace ``base``) features: routes the APIs they implement, e.g. ``log_tensor_stats``.

    Each API requires ``tensor_name``; several features for one call are an error; with no applicable feature the
    call returns ``{}`` (nvdlfw behaviour).  The routing is cached per (layer, api, tensor_name).
    """

    name = BASE_NAMESPACE

    def apis(self) -> FrozenSet[str]:
        registry = self._session.registry
        return frozenset(h for info in registry.features[self.name].values() for h in info.hooks)

    def has_api(self, api: str) -> bool:
        return api in self.apis()

    def call(self, api: str, layer_name: str, **kwargs: Any) -> Any:
        if not self.has_api(api):
            raise AttributeError(f"no section-level (base) feature implements {api!r}")
        if kwargs.get("tensor_name") is None:
            raise TypeError(f"{api}(layer_name={layer_name!r}) needs the keyword argument 'tensor_name'")
        if "iteration" not in kwargs:
            kwargs["iteration"] = self._session.iteration
        key = (layer_name, api, None, kwargs["tensor_name"])
        routes = self._routes.get(key)
        if routes is None:
            routes = self._decide(
                api, layer_name, kwargs, multi=False, gemm_parsing=False, tensor_parsing=True, legacy=frozenset()
            )
            self._routes[key] = routes
        if not routes:
            return {}
        return self._invoke(routes[0], api, layer_name, kwargs, deprecated=False)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self.has_api(name):
            return lambda layer_name, **kwargs: self.call(name, layer_name, **kwargs)
        raise AttributeError(f"no section-level (base) feature implements {name!r}")


# ------------------------------------------------------------------------------------------------- custom namespaces
_NOTHING = ("", None, None)  # cached route of an API that neither a feature nor the default implementation serves


def _cache_value(value: Any) -> Any:
    hash(value)  # TypeError for an unhashable kwarg value: that call is not cached
    return value


class CustomNamespace:
    """``debug_api.<namespace>`` for a namespace registered with ``register_namespace_api`` (nvdlfw-inspect's
    routing, driven by the namespace's `BaseNamespaceAPI` object ``api``).

    ``debug_api.<namespace>.<api>(layer_name, **kwargs)`` (every attribute not starting with ``_`` routes an API):

    1. ``api.input_assertions_hook(api_name, **kwargs)``;
    2. the features of the namespace (registration order) that implement ``api_name`` and have a non-empty, enabled
       config in the layer's section (a config without ``enabled`` is a ValueError) are asked
       ``api.routing_condition(api_name, config, layer_name, feature, **kwargs)`` -> ``(applies, config')``;
    3. no feature applies: the method of ``api._default_api_impl`` named ``api_name`` answers
       (``method({}, layer_name, **kwargs)``), or the call returns ``{}``; one feature: it answers and
       ``api.output_assertions_hook`` checks the result; several: allowed only if
       ``api.is_multiple_feature_invocation_allowed(api_name)`` (else ValueError "Only 1 operation permitted per
       API call"), every result is checked and ``api.handle_multi_feature_output`` combines them.
       Feature and default methods are called through ``api.call_feature``.
    4. The decision of steps 2-3 is cached per (layer, api, values of ``api._cacheable_api_kwargs_map[api_name]``)
       when the API is listed there (multi-feature decisions are not cached, as in nvdlfw); the cache lives until
       ``end_debug()``.  Unlike nvdlfw the key has no call site, and output checks also run on cached routes.

    ``step`` / ``end_debug`` of the session call ``api.step()`` / ``api.end_debug()``.
    """

    def __init__(self, session: Any, name: str, api_class: type):
        self._session = session
        self.name = name
        self.api = api_class()
        if not hasattr(self.api, "_cacheable_api_kwargs_map"):
            raise TypeError(
                f"the API class {api_class.__qualname__} of namespace {name!r} did not set up "
                f"BaseNamespaceAPI (call super().__init__() in its __init__)"
            )
        self.api.name = name
        self._routes: Dict[tuple, tuple] = {}

    @property
    def cache_size(self) -> int:
        return len(self._routes)

    def _cache_key(self, api_name: str, layer_name: str, kwargs: dict) -> Optional[tuple]:
        listed = (self.api._cacheable_api_kwargs_map or {}).get(api_name)
        if listed is None:
            return None
        try:
            return (layer_name, api_name) + tuple(_cache_value(kwargs.get(k, 0)) for k in listed)
        except TypeError:
            return None

    def _select(self, api_name: str, layer_name: str, kwargs: dict) -> list:
        import copy

        block = self._session.config.layer_config(layer_name).get(self.name) or {}
        selected = []
        for info in self._session.registry.features.get(self.name, {}).values():
            cfg = block.get(info.name)
            if api_name not in info.hooks or not cfg:
                continue
            if "enabled" not in cfg:
                raise ValueError(
                    f"layer {layer_name!r}: missing required config field 'enabled' under {self.name}.{info.name}"
                )
            if not cfg["enabled"]:
                continue
            feature = info.instance()
            applies, modified = self.api.routing_condition(api_name, copy.deepcopy(cfg), layer_name, feature, **kwargs)
            if applies:
                selected.append((info.name, getattr(feature, api_name), cfg if modified is None else modified))
        return selected

    def _default_route(self, api_name: str) -> tuple:
        impl = self.api._default_api_impl
        method = getattr(impl, api_name, None) if impl is not None and not api_name.startswith("_") else None
        return ("", method, {}) if callable(method) else _NOTHING

    def route(self, api_name: str, layer_name: str, **kwargs: Any) -> Any:
        api = self.api
        api.input_assertions_hook(api_name, **kwargs)
        key = self._cache_key(api_name, layer_name, kwargs)
        route = self._routes.get(key) if key is not None else None
        if route is None:
            selected = self._select(api_name, layer_name, kwargs)
            if len(selected) > 1:
                names = [name for name, _, _ in selected]
                if not api.is_multiple_feature_invocation_allowed(api_name):
                    raise ValueError(
                        f"Only 1 operation permitted per API call. Found {len(selected)} features "
                        f"{names} enabled for {self.name}.{api_name} on layer {layer_name!r}"
                    )
                outputs = []
                for _, method, cfg in selected:
                    result = api.call_feature(method, cfg, layer_name, **kwargs)
                    api.output_assertions_hook(api_name, result, **kwargs)
                    outputs.append(result)
                return api.handle_multi_feature_output(api_name, outputs, names, **kwargs)
            route = selected[0] if selected else self._default_route(api_name)
            if key is not None:
                self._routes[key] = route
            if route[0]:
                self._session.log_message(
                    f"Debug API call '{self.name}.{api_name}' routed to feature '{route[0]}'.",
                    layer_name,
                    logging.DEBUG,
                )
        feature, method, cfg = route
        if method is None:
            return {}
        result = api.call_feature(method, cfg, layer_name, **kwargs)
        if feature:
            api.output_assertions_hook(api_name, result, **kwargs)
        return result

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(layer_name: str, **kwargs: Any) -> Any:
            return self.route(name, layer_name, **kwargs)

        call.__name__ = name
        return call

    def step(self, finished_iteration: int) -> None:
        self.api.step()

    def end_debug(self) -> None:
        self._routes.clear()
        self.api.end_debug()


def custom_namespaces(session: Any) -> Dict[str, CustomNamespace]:
    """The session's custom namespaces (one per API class in its registry), by name."""
    return {
        name: CustomNamespace(session, name, api_class)
        for name, (api_class, _source) in session.registry.namespace_apis.items()
    }
