"""Where the offload engine meets transformers: the experts interface and the hooks.

``register()`` adds the ``stmoe_offload`` implementation to transformers'
``ExpertsInterface``; with it selected, every experts module's forward comes to
its engine with the router's decision, the model keeping its own routing code.
``take_over`` releases a module's per-expert weights to storage-free meta tensors
and points the module at the engine; ``base_forward`` is the implementation it
used before (its arithmetic, which the engine calls on the gathered experts).
``ForwardHooks`` turns each of the model's own forward calls into a step of the
engine's step API (``runtime.step``: its batch shape and padding mask, prefill or
decode): ``begin_step`` claims the engine for the thread (another thread's call in
progress is a clear busy error), ``end_step`` closes the books, and ``leave_step``
lets the engine go when the call ends, failed or not (a hook with ``always_call``).
It also tells the planner as each decoder layer with a late gate lookahead starts.
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from stmoe.errors import OffloadError
from stmoe.runtime.planning import PrefetchPlanner
from stmoe.runtime.step import Step, current_driver

IMPL_NAME = "stmoe_offload"


def _offloaded_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
    engine = getattr(self, "_stmoe_engine", None)
    if engine is None:
        raise OffloadError(f"{type(self).__name__} uses experts implementation {IMPL_NAME!r} but "
                           "is not offloaded; call stmoe.offload(model, ...)")
    return engine.experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)


def register() -> None:
    """Make ``stmoe_offload`` a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, _offloaded_forward)


def base_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The experts implementation the module used before offloading (its arithmetic)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = inspect.unwrap(type(module).forward)
    impl = getattr(module.config, "_experts_implementation", None) or "eager"
    if impl == IMPL_NAME:
        raise OffloadError("this model is already offloaded")
    return ALL_EXPERTS_FUNCTIONS.get_interface(impl, original)


# transformers' experts implementations that sum each token's top-k expert outputs in
# routing order (reshape + sum), whatever the experts' numbering: for a call of one token
# the result is the same bits when the weights are the cache's slots and the ids slot
# numbers. A call of several tokens groups them by number, so there only a numbering in
# the experts' id order gives the same bits (``serve``: else a copy). The eager loop
# accumulates in expert-id order, so it is not one of them.
# (the last three: quant.experts; vLLM's CPU grouped-GEMM kernel as the vLLM plugin calls
# it, whose tokens are independent too: ``vllm_plugin.layers``; quant.experts' forward as
# the plugin calls it: ``vllm_plugin.own_format``)
_ORDER_FREE = ("grouped_mm", "batched_mm", "stmoe_quantized", "vllm_cpu_fused_moe",
               "vllm_stmoe_quantized")
# of those, the ones whose every token is computed alone whatever the call's other tokens
# and their numbering (vLLM's CPU kernel, and torch's weight-only kernels in the plugin's
# quantized forward: tested bit for bit in tests/vllm_plugin): a call of several tokens
# computes on the slots in place too
_ROWS_FREE = ("vllm_cpu_fused_moe", "vllm_stmoe_quantized")


def any_expert_numbering(module: torch.nn.Module) -> bool:
    """Whether the module's experts implementation gives, for one token, the same bits
    under any numbering of its experts (so the engine may compute on cache slots in
    place; several tokens only with slots in id order)."""
    return getattr(module.config, "_experts_implementation", None) in _ORDER_FREE


def rows_independent(module: torch.nn.Module) -> bool:
    """Whether the module's implementation gives each token the same bits under any
    numbering of its experts whatever the call's other tokens (slots in place for any call)."""
    return getattr(module.config, "_experts_implementation", None) in _ROWS_FREE


class ExpertsEngine(Protocol):
    """Where an offloaded experts module's calls go (``OffloadEngine.experts_forward``)."""

    def experts_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> torch.Tensor: ...


class _Closed:
    """What an experts module points to once its engine is closed: a clear error for a call,
    and no reference back to the engine (whose caches would otherwise live on, on the GPU
    too, until Python's cycle collector ran: module -> engine -> model -> module)."""

    def experts_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise OffloadError("this offloaded model was closed; offload it again to run it")


CLOSED = _Closed()


def let_go(modules: list[torch.nn.Module], gathered: list[GatheredExperts],
           engine: object) -> None:
    """``modules``, taken over by ``engine`` (now closed), no longer refer to it, and their
    stand-ins no longer hold the last call's weights (the caches' memory goes with them)."""
    for module in modules:
        if getattr(module, "_stmoe_engine", None) is engine:
            module._stmoe_engine = CLOSED  # type: ignore[assignment]
    for stand_in in gathered:
        stand_in.unbind()


def take_over(module: torch.nn.Module, engine: ExpertsEngine, num_experts: int,
              device: torch.device) -> None:
    """Release the module's per-expert parameters (storage-free meta tensors from now on)
    and send its experts calls to ``engine.experts_forward`` (which computes them on
    ``device``); every call is checked first (``_unchanged``)."""
    dtypes = {}
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() >= 1 and p.shape[0] == num_experts:
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
            )
            dtypes[name] = p.dtype
    module._stmoe_engine = engine  # type: ignore[assignment]
    module._stmoe_dtypes = dtypes  # type: ignore[assignment]
    if device.type == "cuda" and device.index is None:  # ("cuda": the current one, now)
        device = torch.device("cuda", torch.cuda.current_device())
    module._stmoe_device = device  # type: ignore[assignment]
    module._apply = types.MethodType(_apply_beside_meta, module)  # type: ignore[method-assign]
    module.register_forward_pre_hook(_unchanged)


def _apply_beside_meta(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                       recurse: bool = True) -> torch.nn.Module:
    """``model.to(...)``, ``.cpu()``, ``.half()`` reach the experts module: its meta
    parameters have no data to move (torch's "Cannot copy out of meta tensor" before), so
    they take the new dtype only; a move or a cast is refused at the next call
    (``_unchanged``), and a move to where the experts run already changes nothing."""
    def beside_meta(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return fn(t)
        dtype = fn(torch.empty(0, dtype=t.dtype)).dtype
        return t if dtype == t.dtype else torch.empty(t.shape, dtype=dtype, device="meta")
    return torch.nn.Module._apply(module, beside_meta, recurse)


def _unchanged(module: torch.nn.Module, args: tuple) -> None:
    """Refuse an experts call the offloaded model can no longer compute as it did: the
    model's experts implementation switched from stmoe's (another would compute on the
    storage-free meta parameters: zeros or NaN, no error), the model cast to another
    dtype (the store's experts would be computed in theirs beside the cast model: other
    tokens than the resident model cast alike), or moved to another device than the one
    its experts are served on. The first two were silent before (a review)."""
    impl = getattr(module.config, "_experts_implementation", None)
    if impl != IMPL_NAME:
        raise OffloadError(f"this offloaded model's experts implementation was set to "
                           f"{impl!r} after stmoe.offload; its experts are in stmoe's store, "
                           f"which only {IMPL_NAME!r} reads: choose the implementation before "
                           "offloading")
    for name, dtype in module._stmoe_dtypes.items():  # type: ignore[union-attr, operator]
        now = module._parameters[name].dtype  # type: ignore[union-attr]
        if now != dtype:
            raise OffloadError(f"this offloaded model was cast to {now} after stmoe.offload, "
                               f"but its experts are stored in {dtype}: cast the model "
                               "before offloading it (a fresh load, or its folder)")
    served: torch.device = module._stmoe_device  # type: ignore[assignment]
    now = args[0].device if args and isinstance(args[0], torch.Tensor) else served
    if moved(now, served):
        raise OffloadError(f"this offloaded model was moved to {now} after stmoe.offload, but "
                           f"its experts are served on {served}: offload it on the device it "
                           "runs on (OffloadOptions.device, or the model moved first)")


def moved(now: torch.device, served: torch.device) -> bool:
    """Whether a call on ``now`` is on another device than the experts are ``served`` on
    (an index given on one side only is the same device: "cuda" is the current one)."""
    return now.type != served.type or (None not in (now.index, served.index) and (
        now.index != served.index))


class GatheredExperts:
    """Stands in for an experts module: the gathered experts' weights, all else delegated.

    One per layer, bound to each call's weights (``bind``): what the implementation reads of
    the module (its config, activation, flags: the same few names at every call) is looked
    up once and kept, since a lookup through ``nn.Module.__getattr__`` at every call and
    layer is a measurable share of a small layer's time. Anything the implementation sets
    on it lives for one call only (``bind`` starts afresh)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.__dict__.update(_module=module, _seen={})

    def bind(self, params: dict[str, torch.Tensor], n: int) -> GatheredExperts:
        d = self.__dict__
        module, seen = d["_module"], d["_seen"]
        d.clear()
        d.update(seen)
        d.update(params)
        d.update(num_experts=n, _module=module, _seen=seen)
        return self

    def unbind(self) -> None:
        """Forget the last call's weights (views of the cache's slabs: the engine closed)."""
        d = self.__dict__
        module, seen = d["_module"], d["_seen"]
        d.clear()
        d.update(_module=module, _seen=seen)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["_module"], name)
        if name != "training":  # the one attribute a user may change between calls
            self.__dict__["_seen"][name] = self.__dict__[name] = value
        return value


def resident_device(model: torch.nn.Module) -> torch.device:
    """Where the model's resident (non-meta) weights are; the CPU when there are none."""
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def move_resident(model: torch.nn.Module, device: torch.device) -> None:
    """Move every non-meta parameter and buffer (the experts stay in the store)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta:
                module._parameters[name] = torch.nn.Parameter(p.data.to(device),
                                                              requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to(device)


class StepEngine(Protocol):
    """The engine's step API, as the forward hooks call it (``OffloadEngine``)."""

    def solo_step(self, batch: int, length: int, mask: np.ndarray | None) -> Step: ...
    def begin_step(self, step: Step) -> None: ...
    def end_step(self, step: Step) -> None: ...
    def leave_step(self) -> None: ...


class ForwardHooks:
    """transformers' own forward calls as steps of one part (``StepEngine``); a forward
    driven by a step driver (``runtime.step.driven_by``) is left to its driver."""

    def __init__(self, model: torch.nn.Module, engine: StepEngine,
                 planner: PrefetchPlanner) -> None:
        self.engine, self.planner = engine, planner
        self._steps = threading.local()  # this thread's open steps (nested forwards: a stack)
        self._handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                         model.register_forward_hook(self._after_forward),
                         model.register_forward_hook(self._forward_done, always_call=True)]
        if planner.late is not None:  # predict layer l as layer l starts (the late lookahead)
            self._handles += [decoder_layer.register_forward_pre_hook(self._layer_start(layer),
                                                                      with_kwargs=True)
                              for layer, (decoder_layer, _) in enumerate(planner.late)
                              if layer > 0]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        # the engine holds these hooks: without this the pair (and the engine's model) would
        # live on until Python's cycle collector ran
        del self.engine, self.planner

    def _open(self) -> list[Step | None]:
        stack = getattr(self._steps, "stack", None)
        if stack is None:
            stack = self._steps.stack = []
        return stack

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if current_driver() is not None:  # its driver keeps the books
            self._open().append(None)
            return
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise OffloadError("an offloaded model needs input_ids or inputs_embeds")
        batch, length = int(ids.shape[0]), int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        rows = (mask[:, -length:].detach().to("cpu").bool().numpy()
                if mask is not None and mask.dim() == 2 else None)
        step = self.engine.solo_step(batch, length, rows)
        self.engine.begin_step(step)  # refuses while another thread's step runs
        self._open().append(step)

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self._open()
        if stack and stack[-1] is not None:
            self.engine.end_step(stack[-1])

    def _forward_done(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        """Every forward call's end, even a failed one: its thread lets the engine go."""
        stack = self._open()
        if stack and stack.pop() is not None:
            self.engine.leave_step()

    def _layer_start(self, layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if current_driver() is None:
                self.planner.layer_started(layer, args[0] if args else kwargs["hidden_states"])

        return hook
