"""`tedebug.autocast`: the context that turns on low-precision GEMMs in `tedebug.nn` layers.

Outside any `autocast(enabled=True)` block the layers run in high precision (every quantizer role is None).  Inside,
each layer builds its quantizers from the active recipe.  The state is a stack, so blocks nest (the innermost wins)
and one `autocast` object may be entered several times, also recursively; it works as a decorator too.

Recipe precedence inside an enabled block (what `tedebug.nn` layers use):

1. the recipe passed to the innermost enabled `autocast(recipe=...)`;
2. else the layer's own ``default_recipe`` (set by `tedebug.convert_model(model, recipe=...)`);
3. else one process-wide `tedebug.recipe.DelayedScaling()` (created on first use and then reused, so the delayed
   scaling state of the layers survives from one ``autocast()`` block to the next).
"""

from __future__ import annotations

import contextlib
from typing import List, NamedTuple, Optional, Tuple

__all__ = ["autocast", "autocast_state", "explicit_recipe", "default_recipe", "INNERMOST"]


class _Entry(NamedTuple):
    enabled: bool
    recipe: object  # the recipe given to autocast(), or None


_STACK: List[_Entry] = []
#: the state outside any block
_OUTSIDE = _Entry(False, None)
_DEFAULT_RECIPE = None


class _Innermost:
    """The innermost block's entry, kept up to date on every enter and exit, so that a layer's forward reads the
    autocast state with one attribute look-up (`INNERMOST.enabled`, `INNERMOST.recipe`)."""

    __slots__ = ("enabled", "recipe")

    def __init__(self) -> None:
        self.enabled = False
        self.recipe = None  # the recipe given to the innermost block, or None

    def follow(self) -> None:
        top = _STACK[-1] if _STACK else _OUTSIDE
        self.enabled, self.recipe = top.enabled, top.recipe


#: the state of the innermost autocast block (disabled outside any block); one object for the whole process
INNERMOST = _Innermost()


def default_recipe():
    """The process-wide default recipe (`tedebug.recipe.DelayedScaling()`), created on first use."""
    global _DEFAULT_RECIPE
    if _DEFAULT_RECIPE is None:
        from tedebug.recipe import DelayedScaling

        _DEFAULT_RECIPE = DelayedScaling()
    return _DEFAULT_RECIPE


def explicit_recipe():
    """The recipe given to the innermost enabled autocast block, or None (disabled, or no recipe given)."""
    return INNERMOST.recipe if INNERMOST.enabled else None


def autocast_state() -> Tuple[bool, Optional[object]]:
    """(enabled, recipe) of the innermost autocast block; (False, None) outside any block.

    When enabled and no recipe was given, the recipe is the process-wide default DelayedScaling.
    """
    if not INNERMOST.enabled:
        return False, None
    recipe = INNERMOST.recipe
    return True, recipe if recipe is not None else default_recipe()


class autocast(contextlib.ContextDecorator):
    """Run `tedebug.nn` layers with quantized GEMMs (``enabled=True``) or in high precision (``enabled=False``).

    ``recipe=None`` means: the layer's ``default_recipe`` if it has one, else `tedebug.recipe.DelayedScaling()`
    (see the module docstring for the precedence).
    """

    def __init__(self, enabled: bool = True, recipe=None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast(enabled=...) expects a bool, got {type(enabled).__name__}")
        if recipe is not None and not callable(getattr(recipe, "make_quantizer", None)):
            raise TypeError(
                f"autocast(recipe=...) expects a tedebug.recipe recipe (an object with make_quantizer(role)), "
                f"got {type(recipe).__name__}"
            )
        self.enabled = enabled
        self.recipe = recipe
        self._depths: List[int] = []  # stack sizes at each (possibly re-entrant) __enter__ of this object

    def __enter__(self) -> "autocast":
        self._depths.append(len(_STACK))
        _STACK.append(_Entry(self.enabled, self.recipe))
        INNERMOST.follow()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        depth = self._depths.pop()
        if len(_STACK) != depth + 1:
            raise RuntimeError(
                f"tedebug.autocast: blocks exited out of order (expected stack depth {depth + 1}, found {len(_STACK)})"
            )
        _STACK.pop()
        INNERMOST.follow()

    def __repr__(self) -> str:
        return f"autocast(enabled={self.enabled}, recipe={self.recipe!r})"
