"""Feature registration and loading: `register_feature`, `api_method`, `FeatureMapper`, and the per-session `Registry`.

There is no process-global registry.  `register_feature(namespace=...)` only *tags* a class with its namespace;
`register_namespace_api(namespace=...)` tags the API class of a custom namespace (nvdlfw's `BaseNamespaceAPI`
contract, see `tedebug.namespace.CustomNamespace`); `api_method` only marks a method as a hook implementation.
Each `debug_api.initialize()` builds a fresh `Registry` from the modules it loads:

1. the built-in features: every module of the packages `tedebug.features` and
   `tedebug.compat.nvdlfw_inspect.debug_features` (nvdlfw's generic section-level `LogTensorStats`; a feature file
   may define its own ``base.LogTensorStats``, which then replaces it);
2. the user's `feature_dirs` (a str or a list; None / "" / [] = none), walked recursively in sorted order; every
   ``*.py`` file (except ``__init__.py``, and except files already loaded, e.g. the built-in ones) is executed as a
   fresh module under a unique name, with its own directory temporarily first on ``sys.path`` so sibling imports
   work.  An import error raises `FeatureLoadError` naming the file (the original exception is chained); a missing
   directory raises `FeatureLoadError` naming it.  TransformerEngine's own feature directory
   (``.../transformer_engine/debug/features``, which TE's docs tell users to pass) and nvdlfw-inspect's
   (``.../nvdlfw_inspect/debug_features``, which Megatron passes) are skipped with a log line: tedebug ships its own
   implementations of those features.  While a user file executes, the nvdlfw-inspect module
   names (``nvdlfw_inspect.registry``, ``.api``, ``.base``, ...) and ``transformer_engine.debug.features.api`` resolve
   to tedebug's compatibility modules (`tedebug.compat.aliases`), so features written for nvdlfw-inspect / TE load
   unchanged.

Namespaces: ``transformer_engine`` and ``base`` are tedebug's own; any other identifier is a custom namespace, which
needs exactly one class tagged by `register_namespace_api` among the loaded modules (a feature of a namespace without
one is a `FeatureLoadError` once loading ends).  An API class registered for ``transformer_engine`` or ``base`` (as
TE's and nvdlfw's own ``api.py`` files do) is ignored: tedebug implements those namespaces itself.

A feature is a class defined in a loaded module and tagged by `register_feature`; it is registered under its class
name (which is its YAML key).  In the built-in namespaces it must have ``parse_config_and_api`` (derive from
`FeatureMapper`); in a custom namespace the namespace's ``routing_condition`` decides what it needs.  Its hooks are
the methods (inherited ones included) marked by `api_method`.  Instances are created lazily, once per session.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import keyword
import os
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

NAMESPACES = ("transformer_engine", "base")  # tedebug's own namespaces; any other identifier is a custom one
NAMESPACE_ATTR = "_tedebug_namespace"
NAMESPACE_API_ATTR = "_tedebug_namespace_api"
BUILTIN_PACKAGE = "tedebug.features"
REPLACEABLE_PACKAGE = "tedebug.compat.nvdlfw_inspect.debug_features"  # a feature file may redefine these
BUILTIN_PACKAGES = (BUILTIN_PACKAGE, REPLACEABLE_PACKAGE)
USER_MODULE_PREFIX = "tedebug_user_features"
TE_FEATURE_DIR_TAIL = ("transformer_engine", "debug", "features")
NVDLFW_FEATURE_DIR_TAIL = ("nvdlfw_inspect", "debug_features")


class FeatureLoadError(ImportError):
    """A feature file or directory could not be loaded, or a loaded feature is invalid."""


# ------------------------------------------------------------------------------------------------- decorators
def check_namespace_name(namespace: Any, what: str) -> str:
    """`namespace` when it is a valid namespace name (a Python identifier: it is also an attribute of debug_api)."""
    if (
        not isinstance(namespace, str)
        or not namespace.isidentifier()
        or keyword.iskeyword(namespace)
        or namespace.startswith("_")
    ):
        raise ValueError(
            f"{what}: invalid namespace {namespace!r}; expected {' or '.join(map(repr, NAMESPACES))} "
            f"or the name of a custom namespace (a Python identifier not starting with '_')"
        )
    return namespace


def _class_tagger(attr: str, namespace: str, what: str) -> Callable[[type], type]:
    def tag(cls: type) -> type:
        if not isinstance(cls, type):
            raise TypeError(f"{what} decorates classes, got {type(cls).__name__}")
        setattr(cls, attr, namespace)
        return cls

    return tag


def register_feature(namespace: Union[str, type] = "transformer_engine"):
    """Class decorator tagging a feature class with its namespace (``@register_feature(namespace="base")``).

    Also usable bare (``@register_feature``), meaning namespace ``transformer_engine``.
    """
    if isinstance(namespace, type):  # used without parentheses
        return register_feature()(namespace)
    return _class_tagger(NAMESPACE_ATTR, check_namespace_name(namespace, "register_feature"), "register_feature")


def register_namespace_api(namespace: str):
    """Class decorator tagging the API class of custom namespace `namespace` (nvdlfw's
    ``Registry.register_namespace_api``); the class follows the `BaseNamespaceAPI` contract of
    `tedebug.compat.nvdlfw_inspect.base` and is instantiated once per session with no arguments."""
    return _class_tagger(
        NAMESPACE_API_ATTR, check_namespace_name(namespace, "register_namespace_api"), "register_namespace_api"
    )


def api_method(func: Callable) -> Callable:
    """Mark a feature method as a hook implementation (nvdlfw-compatible: sets ``is_api = True``)."""
    func.is_api = True
    return func


def is_api_method(obj: Any) -> bool:
    return callable(obj) and getattr(obj, "is_api", False) is True


class FeatureMapper:
    """Base class of features: the parsing of ``gemms`` / ``gemms_struct`` / ``tensors`` / ``tensors_struct`` into
    the config one hook call receives (`tedebug.config.parsing`).

    ``parse_config_and_api(config, *, gemm_parsing, tensor_parsing, gemm=None, tensor_name=None)`` returns
    ``(True, parsed_config)`` when the feature applies to this (gemm, tensor) and ``(False, None)`` otherwise.
    Override it for features that apply to whole layers.  Optionally define the classmethod
    ``validate_feature_config(cls, cfg)`` raising ValueError with the offending key (called at config load).
    """

    def parse_config_and_api(
        self,
        config: dict,
        *,
        gemm_parsing: bool = False,
        tensor_parsing: bool = False,
        gemm: Optional[str] = None,
        tensor_name: Optional[str] = None,
        **kwargs: Any,
    ) -> Tuple[bool, Optional[dict]]:
        from tedebug.config.parsing import parse_feature_config

        parsed = parse_feature_config(
            config, gemm=gemm, tensor_name=tensor_name, gemm_parsing=gemm_parsing, tensor_parsing=tensor_parsing
        )
        return (parsed is not None), parsed


# ------------------------------------------------------------------------------------------------- registry
@dataclass
class FeatureInfo:
    """One registered feature class and the hooks it implements."""

    namespace: str
    name: str
    cls: type
    hooks: Tuple[str, ...]
    source: str  # file the class was defined in
    _instance: Any = field(default=None, repr=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"

    def instance(self) -> Any:
        """The session's instance of the feature (created with no arguments on first use)."""
        if self._instance is None:
            self._instance = self.cls()
        return self._instance

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.cls) or ""


def feature_hooks(cls: type) -> Tuple[str, ...]:
    """Names of the `api_method`-marked methods of `cls` (inherited included), sorted."""
    return tuple(sorted(name for name in dir(cls) if not name.startswith("_") and is_api_method(getattr(cls, name))))


class Registry:
    """The features of one session, by namespace and class name (insertion order = load order)."""

    def __init__(self) -> None:
        self.features: Dict[str, Dict[str, FeatureInfo]] = {ns: {} for ns in NAMESPACES}
        self.namespace_apis: Dict[str, Tuple[type, str]] = {}  # custom namespace -> (API class, source file)
        self.ignored_apis: List[str] = []  # "namespace (source)" of API classes for tedebug's own namespaces
        self.replaced: List[str] = []  # "ns.Name: old source -> new source" of replaced nvdlfw generic features
        self.loaded_files: Dict[str, str] = {}  # real path -> module name
        self.skipped_dirs: List[str] = []

    # ------------------------------------------------------------------ registration
    def add(self, cls: type, source: str = "") -> FeatureInfo:
        """Register a tagged feature class; a second class with the same name in one namespace is an error."""
        namespace = cls.__dict__.get(NAMESPACE_ATTR)
        if namespace is None:
            raise FeatureLoadError(f"{cls.__qualname__} ({source}) is not decorated with @register_feature")
        name = cls.__name__
        existing = self.features.setdefault(namespace, {}).get(name)
        if existing is not None:
            if existing.cls is cls:
                return existing
            if existing.cls.__module__.startswith(REPLACEABLE_PACKAGE + "."):
                self.replaced.append(f"{namespace}.{name}: {existing.source} -> {source}")
            else:
                raise FeatureLoadError(
                    f"feature '{namespace}.{name}' is defined twice: in {existing.source} and in {source}; "
                    f"rename one of the classes"
                )
        if namespace in NAMESPACES and not callable(getattr(cls, "parse_config_and_api", None)):
            raise FeatureLoadError(
                f"feature '{namespace}.{name}' ({source}) has no parse_config_and_api method; "
                f"derive it from tedebug.registry.FeatureMapper"
            )
        info = FeatureInfo(namespace, name, cls, feature_hooks(cls), source)
        self.features[namespace][name] = info
        return info

    def add_namespace_api(self, cls: type, source: str = "") -> None:
        """Register the API class of a custom namespace (ignored for tedebug's own namespaces, see above)."""
        namespace = cls.__dict__[NAMESPACE_API_ATTR]
        if namespace in NAMESPACES:
            self.ignored_apis.append(f"{namespace} ({source})")
            return
        existing = self.namespace_apis.get(namespace)
        if existing is not None and existing[0] is not cls:
            raise FeatureLoadError(
                f"namespace {namespace!r} has two API classes: {existing[0].__qualname__} in "
                f"{existing[1]} and {cls.__qualname__} in {source}; keep one"
            )
        for hook in (
            "input_assertions_hook",
            "routing_condition",
            "output_assertions_hook",
            "is_multiple_feature_invocation_allowed",
        ):
            if not callable(getattr(cls, hook, None)):
                raise FeatureLoadError(
                    f"the API class {cls.__qualname__} of namespace {namespace!r} ({source}) has no "
                    f"method {hook}; derive it from nvdlfw_inspect.base.BaseNamespaceAPI "
                    f"(tedebug.compat.nvdlfw_inspect.base)"
                )
        self.namespace_apis[namespace] = (cls, source)
        self.features.setdefault(namespace, {})

    def add_module(self, module: Any) -> List[FeatureInfo]:
        """Register every tagged class *defined in* `module` (imported or subclassed-but-untagged ones are not)."""
        source = getattr(module, "__file__", None) or module.__name__
        found = []
        for value in list(vars(module).values()):
            if not isinstance(value, type) or value.__module__ != module.__name__:
                continue
            if NAMESPACE_API_ATTR in value.__dict__:
                self.add_namespace_api(value, source)
            if NAMESPACE_ATTR in value.__dict__:
                found.append(self.add(value, source))
        return found

    def check_namespaces(self) -> None:
        """FeatureLoadError for features of a custom namespace that has no API class (after loading)."""
        for namespace, features in self.features.items():
            if namespace not in NAMESPACES and namespace not in self.namespace_apis and features:
                raise FeatureLoadError(
                    f"Found features {sorted(features)} for namespace {namespace!r} but API was not found: register "
                    f"its API class with @Registry.register_namespace_api(namespace={namespace!r}) "
                    f"({', '.join(sorted({info.source for info in features.values()}))})"
                )

    @property
    def custom_namespaces(self) -> List[str]:
        return list(self.namespace_apis)

    # ------------------------------------------------------------------ loading
    def load_builtin(self, packages: Union[str, Sequence[str]] = BUILTIN_PACKAGES) -> None:
        """Import every module of the built-in feature packages and register their features."""
        for package in [packages] if isinstance(packages, str) else packages:
            self._load_package(package)

    def _load_package(self, package: str) -> None:
        pkg = importlib.import_module(package)
        self._mark_loaded(pkg)
        for entry in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda e: e.name):
            module_name = f"{package}.{entry.name}"
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                path = os.path.join(pkg.__path__[0], entry.name + ("/" if entry.ispkg else ".py"))
                raise FeatureLoadError(
                    f"failed to import built-in feature module {path}: {type(exc).__name__}: {exc}"
                ) from exc
            self._mark_loaded(module)
            self.add_module(module)

    def load_dirs(self, feature_dirs: Union[None, str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> None:
        """Load every feature file under the given directories (see the module docstring)."""
        for directory in normalize_feature_dirs(feature_dirs):
            if not os.path.isdir(directory):
                raise FeatureLoadError(f"feature directory not found: {directory!r} (from feature_dirs)")
            if is_te_feature_dir(directory) or is_nvdlfw_feature_dir(directory):
                self.skipped_dirs.append(directory)
                continue
            for path in walk_python_files(directory):
                self.load_file(path)

    def load_file(self, path: str) -> None:
        """Execute one feature file as a fresh module and register its features (once per real path)."""
        real = os.path.realpath(path)
        if real in self.loaded_files:
            return
        module = import_file(real)
        self.loaded_files[real] = module.__name__
        self.add_module(module)

    def _mark_loaded(self, module: Any) -> None:
        file = getattr(module, "__file__", None)
        if file:
            self.loaded_files[os.path.realpath(file)] = module.__name__

    # ------------------------------------------------------------------ queries
    def get(self, namespace: str, name: str) -> Optional[FeatureInfo]:
        return self.features.get(namespace, {}).get(name)

    def instance(self, namespace: str, name: str) -> Any:
        info = self.get(namespace, name)
        if info is None:
            raise KeyError(f"no feature '{namespace}.{name}' is registered")
        return info.instance()

    def feature_names(self) -> Dict[str, set]:
        """namespace -> feature names the config loader accepts: the registered ones (a section-level block naming
        a feature that is not registered in ``base`` is a config error, never silently inert)."""
        return {ns: set(features) for ns, features in self.features.items()}

    def feature_validators(self) -> Dict[Tuple[str, str], Callable[[dict], None]]:
        """(namespace, feature name) -> ``validate_feature_config`` for the features that define one."""
        return {
            (ns, name): info.cls.validate_feature_config
            for ns, features in self.features.items()
            for name, info in features.items()
            if callable(getattr(info.cls, "validate_feature_config", None))
        }

    def all_features(self) -> List[FeatureInfo]:
        return [info for features in self.features.values() for info in features.values()]

    def qualified_names(self) -> List[str]:
        """``["base.X", ..., "transformer_engine.Y", ...]`` sorted by namespace then name."""
        return sorted(info.qualified_name for info in self.all_features())

    def hook_providers(self, namespace: str, hook: str) -> List[str]:
        return [name for name, info in self.features[namespace].items() if hook in info.hooks]


def build_registry(feature_dirs=None) -> Registry:
    """A registry of the built-in features plus those found under `feature_dirs`."""
    registry = Registry()
    registry.load_builtin()
    registry.load_dirs(feature_dirs)
    registry.check_namespaces()
    return registry


# ------------------------------------------------------------------------------------------------- helpers
def normalize_feature_dirs(feature_dirs) -> List[str]:
    """None / "" / [] -> []; a str or PathLike -> [it]; a list/tuple -> its items (each a non-empty path)."""
    if feature_dirs is None or (isinstance(feature_dirs, str) and feature_dirs == ""):
        return []
    if isinstance(feature_dirs, (str, os.PathLike)):
        return [os.fspath(feature_dirs)]
    if isinstance(feature_dirs, (list, tuple)):
        dirs = []
        for i, item in enumerate(feature_dirs):
            if not isinstance(item, (str, os.PathLike)) or os.fspath(item) == "":
                raise TypeError(f"feature_dirs[{i}] must be a non-empty path string, got {item!r}")
            dirs.append(os.fspath(item))
        return dirs
    raise TypeError(f"feature_dirs must be a str or a list of str, got {type(feature_dirs).__name__}")


def is_te_feature_dir(directory: str) -> bool:
    """True for TransformerEngine's own ``transformer_engine/debug/features`` directory."""
    parts = os.path.normpath(os.path.realpath(directory)).split(os.sep)
    return tuple(parts[-3:]) == TE_FEATURE_DIR_TAIL


def is_nvdlfw_feature_dir(directory: str) -> bool:
    """True for nvdlfw-inspect's own ``nvdlfw_inspect/debug_features`` directory (tedebug's is not skipped: it is
    loaded as a package, never as a feature directory)."""
    parts = os.path.normpath(os.path.realpath(directory)).split(os.sep)
    return tuple(parts[-2:]) == NVDLFW_FEATURE_DIR_TAIL


def walk_python_files(directory: str) -> Iterable[str]:
    """Every ``*.py`` under `directory` (recursively, sorted; skips ``__init__.py``, hidden and cache dirs)."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py") and name != "__init__.py":
                yield os.path.join(root, name)


def user_module_name(path: str) -> str:
    """A unique, stable module name for a feature file: ``tedebug_user_features__<stem>_<hash of path>``."""
    stem = os.path.splitext(os.path.basename(path))[0]
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    digest = hashlib.sha1(path.encode("utf-8")).hexdigest()[:12]
    return f"{USER_MODULE_PREFIX}__{safe}_{digest}"


def import_file(path: str) -> Any:
    """Execute `path` as a new module (replacing an earlier one of the same file) with its dir on sys.path."""
    name = user_module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FeatureLoadError(f"cannot load feature file {path}: not a Python source file")
    from tedebug.compat.aliases import compat_imports

    module = importlib.util.module_from_spec(spec)
    directory = os.path.dirname(path)
    sys.modules[name] = module
    sys.path.insert(0, directory)
    try:
        with compat_imports():
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise FeatureLoadError(f"failed to import feature file {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        try:
            sys.path.remove(directory)
        except ValueError:  # the file itself removed it; nothing left to undo
            pass
    return module
