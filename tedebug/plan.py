"""The compiled debug plan of one tensor: `TensorPlan`, built once per session from the config and the namespace.

A `TensorPlan` answers, for one (layer, tensor name, layer has a normal quantizer for it or not), the questions
`DebugQuantizer` asks at every debug iteration, in the order of TransformerEngine's debug quantizer:

1. ``inspect_tensor_enabled``;
2. ``inspect_tensor_postquantize_enabled`` for the rowwise and then the columnwise GEMM (not for GEMM outputs);
3. per direction (rowwise GEMM first) the `Plan`: ``modify_tensor_enabled`` -> `Plan.MODIFY`, else with a normal
   quantizer ``fp8_gemm_enabled`` -> `Plan.QUANTIZE`, else `Plan.HIGH_PRECISION`.

Each ``*_enabled`` question of one routing key (hook, GEMM) is compiled, the first time it is needed, into one
*answer*:

* `ConstantAnswer`: no feature serves the key, so the hook's default answers, every iteration;
* `ScheduledAnswer`: every serving feature declares the hook schedule-only (below): the plan evaluates their
  parsed schedules itself (and records the next iteration in the stats engine where the feature would);
* `CalledAnswer`: anything else - the hook is called through the namespace at every question, so a feature whose
  answer depends on more than its schedule, or a hook overridden on the namespace instance, sees every call.

When every direction question has a constant answer, the plan holds the directions and postquantize flags as
constants (`TensorPlan.fixed`) and a debug iteration asks only question 1.  The next iteration at which anything
of the tensor may change is the smallest next iteration of the answers asked (`DebugQuantizer.get_next_debug_iter`).

Schedule-only declaration: a feature class lists in ``SCHEDULE_ONLY_HOOKS`` the ``*_enabled`` hooks whose answer
is ``Schedule.from_config(config).query(iteration)`` of the routed config (and whose next iteration is recorded in
the stats engine when the class says ``NOTE_STATS = True``).  The declaration counts only on the class that defines
the hook method: a subclass that overrides the method is called again unless it declares the hook itself.

Inspection: `InspectCall` is the plan's one bound ``inspect_tensor``.  Its first call routes the key through the
namespace; from then on each plain feature route is called directly, several of them one after the other in the
namespace's order - through the feature's bound form ``bind_inspect_tensor(config, layer_name, tensor_name) ->
call(iteration, tensor, tp_group, tp_size, rowwise, columnwise, quantizer)`` when the class that defines
``inspect_tensor`` also defines it, else through the feature method - and any other case (a deprecated hook, kwargs
a feature does not take, an override on the namespace instance) through the namespace.

Plans live in the namespace's `compiled` table (one session; dropped at `end_debug()` and whenever a hook is
overridden on the namespace instance).  ``debug_api.initialize(..., plan_cache=False)`` turns them off: every
`DebugQuantizer` then compiles a plan of `CalledAnswer`s through ``debug_api.transformer_engine`` (attribute
lookup, so a stand-in installed there by a test sees every hook call) and inspects through it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from tedebug.config.parsing import GEMMS_OF_TENSOR
from tedebug.config.schedule import Schedule
from tedebug.namespace import HOOKS, check_output

INSPECT_ENABLED = "inspect_tensor_enabled"
POSTQUANTIZE_ENABLED = "inspect_tensor_postquantize_enabled"
MODIFY_ENABLED = "modify_tensor_enabled"
QUANTIZED_GEMM_ENABLED = "fp8_gemm_enabled"
INSPECT = "inspect_tensor"


class Plan(str, enum.Enum):
    """What feeds one GEMM direction of a tensor; the values are the strings of the plan log lines."""

    MODIFY = "modify_tensor()"
    QUANTIZE = "Quantize"
    HIGH_PRECISION = "High Precision"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def enabled_and_next(result: Any, iteration: int, *, hook: str, layer_name: str) -> Tuple[bool, Optional[int]]:
    """Normalise a `*_enabled` hook result to ``(enabled, next_iteration_or_None)``.

    A tuple ``(bool, next)`` is taken as is; a bare bool (deprecated form) means "ask again next iteration".
    """
    if isinstance(result, tuple):
        if len(result) != 2:
            raise TypeError(
                f"{hook}() for layer {layer_name!r} returned a tuple of length {len(result)}; "
                f"expected (bool, Optional[int])"
            )
        enabled, nxt = result
        if nxt is not None and not isinstance(nxt, int):
            raise TypeError(
                f"{hook}() for layer {layer_name!r} returned next iteration {nxt!r}; expected an int or None"
            )
        return bool(enabled), nxt
    if isinstance(result, bool):
        return result, iteration + 1
    raise TypeError(
        f"{hook}() for layer {layer_name!r} returned {type(result).__name__}; expected bool or (bool, Optional[int])"
    )


def min_next(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """The earlier of two next iterations (None: never)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a < b else b


# ------------------------------------------------------------------------------------------------ answers
class ConstantAnswer:
    """A hook no feature serves for this routing key: its default, at every iteration."""

    __slots__ = ("value",)
    constant = True

    def __init__(self, value: Tuple[bool, Optional[int]]) -> None:
        self.value = value

    def ask(self, iteration: int) -> Tuple[bool, Optional[int]]:
        return self.value


class ScheduleClock:
    """One distinct schedule of a session and its answer at the last iteration asked: every `ScheduledAnswer` whose
    feature has an equal schedule holds the same clock (`schedule_clock`), so the six tensors of every GEMM selected
    by one config section evaluate that schedule once per iteration, not once per tensor."""

    __slots__ = ("schedule", "last")

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        #: (iteration, `Schedule.query(iteration)`) of the last iteration asked (one tuple: threads read it whole)
        self.last: Tuple[Optional[int], Tuple[bool, Optional[int]]] = (None, (False, None))

    def query(self, iteration: int) -> Tuple[bool, Optional[int]]:
        """`Schedule.query(iteration)`, evaluated once per iteration."""
        last = self.last
        if last[0] != iteration:
            last = self.last = (iteration, self.schedule.query(iteration))
        return last[1]


SCHEDULE_CLOCKS_KEY = "schedule clocks"


def compiled_table(api: Any, key: str) -> dict:
    """The dict the namespace's `compiled` table keeps under `key` (made at first use; dropped with the table when
    the namespace drops what it compiled): the plans, the schedule clocks and the shared schedule answers."""
    table = api.compiled.get(key)
    if table is None:
        table = api.compiled[key] = {}
    return table


def schedule_clock(api: Any, schedule: Schedule) -> ScheduleClock:
    """The session's clock of `schedule` (equal schedules share one), kept in the namespace's `compiled` table like
    the plans (dropped with them)."""
    clocks = compiled_table(api, SCHEDULE_CLOCKS_KEY)
    clock = clocks.get(schedule)
    if clock is None:
        clock = clocks[schedule] = ScheduleClock(schedule)
    return clock


class ScheduledAnswer:
    """Every serving feature answers from its schedule alone: evaluate the schedules here (through their shared
    `ScheduleClock`s), in routing order, each recording its next iteration in the stats engine when its feature
    would (several answers are combined as the namespace combines them: enabled if any is, the earliest next
    iteration)."""

    __slots__ = ("entries", "layer_name", "note")
    constant = False

    def __init__(self, entries: Tuple[Tuple[ScheduleClock, bool], ...], layer_name: str, note: Callable) -> None:
        #: (schedule clock, records its next iteration) per serving feature
        self.entries = entries
        self.layer_name = layer_name
        #: the stats engine's `note_next_iteration`
        self.note = note

    def ask(self, iteration: int) -> Tuple[bool, Optional[int]]:
        if len(self.entries) == 1:
            clock, noted = self.entries[0]
            last = clock.last  # (`clock.query` written out for its usual case: asked already at this iteration)
            answer = last[1] if last[0] == iteration else clock.query(iteration)
            if noted:
                self.note(self.layer_name, answer[1])
            return answer
        enabled, nxt = False, None
        for clock, noted in self.entries:
            active, n = clock.query(iteration)
            if noted:
                self.note(self.layer_name, n)
            enabled = enabled or active
            nxt = min_next(nxt, n)
        return enabled, nxt


class CalledAnswer:
    """The hook is called (through the namespace or the stand-in given) at every question."""

    __slots__ = ("method", "hook", "layer_name", "kwargs")
    constant = False

    def __init__(self, api: Any, hook: str, layer_name: str, gemm: Optional[str], tensor_name: Optional[str]):
        self.method = getattr(api, hook)
        self.hook = hook
        self.layer_name = layer_name
        self.kwargs = {k: v for k, v in (("gemm", gemm), ("tensor_name", tensor_name)) if v is not None}

    def ask(self, iteration: int) -> Tuple[bool, Optional[int]]:
        result = self.method(self.layer_name, iteration=iteration, **self.kwargs)
        return enabled_and_next(result, iteration, hook=self.hook, layer_name=self.layer_name)


Answer = Any  # ConstantAnswer | ScheduledAnswer | CalledAnswer


def declared_by_owner(feature: Any, method_name: str, declaration: Callable[[type], bool]) -> bool:
    """True when the class that defines `method_name` for `feature` (the first in its MRO holding it; an attribute
    set on the instance counts as undeclared) satisfies `declaration`."""
    if method_name in vars(feature):
        return False
    for cls in type(feature).__mro__:
        if method_name in cls.__dict__:
            return declaration(cls)
    return False


def schedule_only(feature: Any, hook: str) -> bool:
    """The feature declares `hook` schedule-only on the class that defines it (see the module docstring)."""
    return declared_by_owner(feature, hook, lambda cls: hook in cls.__dict__.get("SCHEDULE_ONLY_HOOKS", ()))


def compile_answer(
    api: Any, session: Any, hook: str, layer_name: str, gemm: Optional[str], tensor_name: Optional[str]
) -> Answer:
    """The answer of one routing key of the session's own namespace `api` (routing it now if it is new)."""
    if api.overridden(hook):
        return CalledAnswer(api, hook, layer_name, gemm, tensor_name)
    routes = api.routes(hook, layer_name, gemm, tensor_name)
    if not routes:
        return ConstantAnswer(HOOKS[hook].default(layer_name, {}))
    features = [getattr(route.method, "__self__", None) for route in routes]
    if all(not r.drop for r in routes) and all(f is not None and schedule_only(f, hook) for f in features):
        entries = tuple(
            (schedule_clock(api, Schedule.from_config(r.config)), bool(getattr(f, "NOTE_STATS", False)))
            for r, f in zip(routes, features)
        )
        # one object per distinct (schedules, layer): the tensors of a layer that one config section selects share
        # it, so a GEMM call's six quantizers ask it once (`renew_quantizers`).  Only these answers are shared: asked
        # twice in a row at one iteration, one gives the same answer and notes the same value again
        answers = compiled_table(api, SCHEDULED_ANSWERS_KEY)
        answer = answers.get((entries, layer_name))
        if answer is None:
            answer = answers[(entries, layer_name)] = ScheduledAnswer(
                entries, layer_name, session.stats.note_next_iteration
            )
        return answer
    return CalledAnswer(api, hook, layer_name, gemm, tensor_name)


SCHEDULED_ANSWERS_KEY = "scheduled answers"


# ------------------------------------------------------------------------------------------------ inspection
class InspectCall:
    """The plan's one bound ``inspect_tensor`` (see the module docstring): ``call(iteration, tensor, tp_group,
    tp_size, rowwise, columnwise, quantizer)``."""

    __slots__ = ("api", "layer_name", "tensor_name", "cacheable", "target", "_basic")

    def __init__(self, api: Any, layer_name: str, tensor_name: str, cacheable: bool) -> None:
        self.api = api
        self.layer_name = layer_name
        self.tensor_name = tensor_name
        #: False: always through `api` (plan cache off)
        self.cacheable = cacheable
        #: the bound call (`bind`), or None before the first call and while calls go through the namespace.  It is
        #: current unless the namespace's ``inspect_tensor`` was replaced since (``INSPECT in api.__dict__``): what
        #: `__call__` checks, and what a caller that takes `target` itself must check
        self.target: Optional[Callable] = None
        self._basic: Optional[bool] = None

    def feeds_basic_statistics(self) -> bool:
        """Whether a feature this call reaches declares ``FEEDS_BASIC_STATISTICS`` (it feeds the tensor's basic
        statistics, which a quantizer's amax pass can compute on the way: `Quantizer.high_precision_stats`).  Only
        for directly called features (routed now if new); a call through the namespace answers False."""
        known = self._basic
        if known is None or INSPECT in self.api.__dict__:
            known = False
            if self.cacheable and not self.api.overridden(INSPECT):
                routes = self.api.routes(INSPECT, self.layer_name, None, self.tensor_name)
                known = any(
                    getattr(getattr(route.method, "__self__", None), "FEEDS_BASIC_STATISTICS", False)
                    for route in routes
                )
            self._basic = known
        return known

    def __call__(
        self, iteration: int, tensor: Any, tp_group: Any, tp_size: int, rowwise: Any, columnwise: Any, quantizer: Any
    ) -> None:
        target = self.target
        if target is None or INSPECT in self.api.__dict__:  # not bound yet, or overridden since: ask again
            target = self.bind()
        target(iteration, tensor, tp_group, tp_size, rowwise, columnwise, quantizer)

    def _through_namespace(
        self, iteration: int, tensor: Any, tp_group: Any, tp_size: int, rowwise: Any, columnwise: Any, quantizer: Any
    ) -> None:
        self.api.inspect_tensor(
            self.layer_name,
            tensor=tensor,
            tensor_name=self.tensor_name,
            iteration=iteration,
            tp_group=tp_group,
            tp_size=tp_size,
            rowwise_quantized_tensor=rowwise,
            columnwise_quantized_tensor=columnwise,
            quantizer=quantizer,
        )

    def bind(self) -> Callable:
        """Route the key (the namespace checks the names and logs the routing, as a call would) and pick the call:
        kept as `target` unless it goes through the namespace."""
        api = self.api
        if not self.cacheable or api.overridden(INSPECT):
            self.target = None
            return self._through_namespace
        routes = api.routes(INSPECT, self.layer_name, None, self.tensor_name)
        if not routes:
            target = _nothing_to_inspect
        elif HOOKS[INSPECT].deprecated or any(route.drop for route in routes):
            target = self._through_namespace
        elif len(routes) == 1:
            target = self._direct(routes[0])
        else:  # several features inspect the tensor: each called directly, in the namespace's order
            target = _in_turn(tuple(self._direct(route) for route in routes))
        self.target = target
        return target

    def _direct(self, route: Any) -> Callable:
        feature = getattr(route.method, "__self__", None)
        if feature is not None and declared_by_owner(
            feature, INSPECT, lambda cls: "bind_inspect_tensor" in cls.__dict__
        ):
            bound = feature.bind_inspect_tensor(route.config, self.layer_name, self.tensor_name)
            if bound is not None:
                return bound
        method, config, layer_name, tensor_name = route.method, route.config, self.layer_name, self.tensor_name
        spec, name = HOOKS[INSPECT], route.feature

        def call(
            iteration: int, tensor: Any, tp_group: Any, tp_size: int, rowwise: Any, columnwise: Any, quantizer: Any
        ) -> None:
            result = method(
                config,
                layer_name,
                tensor=tensor,
                tensor_name=tensor_name,
                iteration=iteration,
                tp_group=tp_group,
                tp_size=tp_size,
                rowwise_quantized_tensor=rowwise,
                columnwise_quantized_tensor=columnwise,
                quantizer=quantizer,
            )
            if result is not None:
                check_output(spec, name, layer_name, {}, result)

        return call


def _in_turn(calls: Tuple[Callable, ...]) -> Callable:
    """One inspect call that makes `calls` one after the other (a failure stops the rest, as in the namespace)."""

    def call(
        iteration: int, tensor: Any, tp_group: Any, tp_size: int, rowwise: Any, columnwise: Any, quantizer: Any
    ) -> None:
        for each in calls:
            each(iteration, tensor, tp_group, tp_size, rowwise, columnwise, quantizer)

    return call


def _nothing_to_inspect(*args: Any) -> None:
    """No feature serves ``inspect_tensor`` for the key: the namespace's default does nothing."""


# ------------------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True, eq=False)
class TensorPlan:
    """The compiled plan of one (layer, tensor, has a normal quantizer); see the module docstring."""

    layer_name: str
    tensor_name: str
    has_parent: bool
    rowwise_gemm: str
    columnwise_gemm: Optional[str]  # None for GEMM outputs (output, wgrad, dgrad)
    #: the namespace (or stand-in) the hooks are asked through
    api: Any
    #: the answer of question 1
    inspect_enabled: Answer
    #: the bound inspect_tensor
    inspect: InspectCall
    #: (rowwise plan, columnwise plan, rowwise postquantize, columnwise postquantize) when constant, else None
    fixed: Optional[Tuple[Plan, Optional[Plan], bool, bool]]
    #: False: compiled for one construction (plan cache off)
    cacheable: bool
    #: session (for answers compiled later) and the compiled answers by (hook, gemm), filled as first needed
    session: Any = field(repr=False, default=None)
    answers: Dict[Tuple[str, Optional[str]], Answer] = field(repr=False, default_factory=dict)

    @property
    def is_output_type(self) -> bool:
        return self.columnwise_gemm is None

    def answer(self, hook: str, gemm: Optional[str]) -> Answer:
        """The compiled answer of (hook, gemm) for this tensor (compiled now if new)."""
        key = (hook, gemm)
        found = self.answers.get(key)
        if found is None:
            found = self.answers[key] = self._compile(hook, gemm)
        return found

    def _compile(self, hook: str, gemm: Optional[str]) -> Answer:
        tensor = self.tensor_name
        if not self.cacheable:
            return CalledAnswer(
                self.api, hook, self.layer_name, gemm, None if hook == QUANTIZED_GEMM_ENABLED else tensor
            )
        return compile_answer(
            self.api, self.session, hook, self.layer_name, gemm, None if hook == QUANTIZED_GEMM_ENABLED else tensor
        )

    def directions(self, iteration: int) -> Tuple[Plan, Optional[Plan], bool, bool, Optional[int]]:
        """Questions 2 and 3 at `iteration`: (rowwise plan, columnwise plan, rowwise postquantize, columnwise
        postquantize, the earliest next iteration of the answers asked)."""
        answer = self.answer
        nxt: Optional[int] = None
        if self.is_output_type:
            modify, n = answer(MODIFY_ENABLED, self.rowwise_gemm).ask(iteration)
            return (Plan.MODIFY if modify else Plan.HIGH_PRECISION), None, False, False, n
        post_row, n = answer(POSTQUANTIZE_ENABLED, self.rowwise_gemm).ask(iteration)
        nxt = min_next(nxt, n)
        post_col, n = answer(POSTQUANTIZE_ENABLED, self.columnwise_gemm).ask(iteration)
        nxt = min_next(nxt, n)
        plans = []
        for gemm in (self.rowwise_gemm, self.columnwise_gemm):
            modify, n = answer(MODIFY_ENABLED, gemm).ask(iteration)
            nxt = min_next(nxt, n)
            if modify:
                plans.append(Plan.MODIFY)
                continue
            if self.has_parent:
                quantized, n = answer(QUANTIZED_GEMM_ENABLED, gemm).ask(iteration)
                nxt = min_next(nxt, n)
                if quantized:
                    plans.append(Plan.QUANTIZE)
                    continue
            plans.append(Plan.HIGH_PRECISION)
        return plans[0], plans[1], post_row, post_col, nxt

    def log_directions(self, rowwise: Plan, columnwise: Optional[Plan]) -> None:
        """The plan lines of both directions in the main log (once per session and distinct line)."""
        if columnwise is None:
            return
        log = self.session.log_message
        for gemm, plan in ((self.rowwise_gemm, rowwise), (self.columnwise_gemm, columnwise)):
            log(f"Tensor: {self.tensor_name}, gemm {gemm} - {plan.value}", self.layer_name)


def compile_plan(
    session: Any, api: Any, layer_name: str, tensor_name: str, has_parent: bool, iteration: int, cacheable: bool
) -> Tuple[TensorPlan, Optional[tuple]]:
    """Compile the plan of one tensor, asking its questions at `iteration` in TransformerEngine's order (each once);
    returns the plan and that iteration's answers: ``((inspect enabled, next), directions(iteration))``.  The plan
    is `fixed` when every direction answer asked is constant (and the plan is cacheable)."""
    rowwise_gemm, columnwise_gemm = GEMMS_OF_TENSOR[tensor_name]
    if cacheable:
        inspect_enabled = compile_answer(api, session, INSPECT_ENABLED, layer_name, None, tensor_name)
    else:
        inspect_enabled = CalledAnswer(api, INSPECT_ENABLED, layer_name, None, tensor_name)
    plan = TensorPlan(
        layer_name,
        tensor_name,
        has_parent,
        rowwise_gemm,
        columnwise_gemm,
        api,
        inspect_enabled,
        InspectCall(api, layer_name, tensor_name, cacheable),
        None,
        cacheable,
        session,
    )
    enabled = inspect_enabled.ask(iteration)
    directions = plan.directions(iteration)
    plan.log_directions(directions[0], directions[1])
    if cacheable and all(a.constant for a in plan.answers.values()):
        object.__setattr__(plan, "fixed", directions[:4])
    return plan, (enabled, directions)


PLANS_KEY = "tensor plans"


def plan_table(api: Any) -> dict:
    """The session's compiled plans, kept in the namespace's `compiled` table (dropped with it)."""
    return compiled_table(api, PLANS_KEY)
