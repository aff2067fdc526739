"""Trace one training step on fake tensors: every tensor allocation and free, with its size, category
and phase, in the order they happen. No memory is used and no GPU is needed.

The model is built on the meta device with its real architecture (and peft adapters), then every
parameter and buffer is replaced by a fake CPU tensor (building under FakeTensorMode breaks peft, whose
`swap_tensors` refuses tensors with weakrefs). Two steps run, so that the second has optimizer state;
the events of both are kept (the caching-allocator simulation needs the whole history).

Private torch API in use, guarded in `tracing_available()`: FakeTensorMode (torch._subclasses) and
TorchDispatchMode (torch.utils._python_dispatch). transformers' mask code is steered to its real-tensor
path, and the grouped matmul's fake kernel takes the dtypes its real kernels take (see `_as_on_real_tensors`).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tunecast.step.chunking import Chunks
from tunecast.step.settings import TraceSettings

# Event kinds: allocation, free, and a change of category (a gradient or optimizer state identified).
ALLOC, FREE, RECLASS = "a", "f", "c"
CATEGORIES = ("weights", "trainable_weights", "gradients", "optimizer", "activations", "temporaries")
PHASES = ("setup", "forward", "backward", "optimizer")
STEPS = 2
# bitsandbytes' optimizers keep the states of tensors under this many elements in fp32 (its `min_8bit_size`).
SMALL_TENSOR_NUMEL = 4096
# The figures a trace sums over the measured step's operations (besides FLOPs), for the throughput model.
# Whether this process has traced (a step or a loss alone): the fake-tensor machinery is then imported, and a loss
# traced alone costs a fraction of a second instead of the seconds of its first import (profiles.py `_composed`).
_TRACED_BEFORE = [False]


def traced_before() -> bool:
    return _TRACED_BEFORE[0]


SUMMED = ("elementwise_bytes", "moved_bytes", "optimizer_bytes", "random_elements", "transcendental_bytes",
          "kernels")


@dataclass(frozen=True)
class Event:
    kind: str
    key: int
    nbytes: int = 0
    category: str = ""
    phase: str = ""
    step: int = 0


@dataclass(frozen=True)
class Trace:
    """What one traced step gives: its allocation events, facts about the model, and the floating-point
    operations of the second step (`matmul` and `attention`, multiply-adds counted as two)."""

    events: list[Event]
    facts: ModelFacts
    flops: dict[str, float]
    terms: dict[str, list[Any]] = field(default_factory=dict)
    """With a reader (a trace at marker dimensions): the polynomial terms of every figure of `flops` and of
    the facts' sums (`fact_*`), one per tensor or operation; `unread` counts what had no reading."""
    unread: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """What the traced (shallow) model is made of, for the terms a trace cannot see."""

    attention: str  # the attention implementation transformers chose
    quantizable_numel: int  # frozen nn.Linear weights inside decoder layers (what QLoRA quantizes)
    largest_quantizable_numel: int  # the biggest of those (its dequantized copy is a temporary)
    trainable_numel: int
    trainable_small_numel: int  # trainable tensors under 4096 elements (8-bit optimizers keep fp32 state)
    trainable_tensors: int
    layer_numel: int  # parameters of one decoder layer (FSDP gathers a layer at a time)
    layer_bytes: int
    param_dtype_bytes: int
    layer_linears: tuple[tuple[int, int, bool], ...] = ()  # (in, out, weight trains) of one decoder layer
    head_linear: tuple[int, int, bool] = (0, 0, False)  # the output head


def tracing_available() -> str | None:
    """None when the private torch API the tracer needs is present, else why not."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
    except ImportError as error:  # pragma: no cover - depends on the torch build
        return f"this torch lacks the fake-tensor API ({error})"
    return None


class _Recorder:
    """Records storage allocations seen by the dispatch mode, and their frees via weak references."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._keys: dict[int, int] = {}  # id(storage) -> key
        self._next = 0
        self.category = "weights"
        self.phase = "setup"
        self.step = 0
        self.closed = False
        self.counting = False  # True while the measured step's forward and backward run
        self.counting_optimizer = False  # True while the measured step's optimizer steps
        self.elementwise_bytes = 0  # bytes written to new tensors by operations other than matmuls
        self.moved_bytes = 0  # bytes read and written by operations other than matmuls (forward, backward)
        self.optimizer_bytes = 0  # bytes read and written by the optimizer step
        self.random_elements = 0  # random numbers drawn (dropout's masks): costly per element on a CPU
        self.transcendental_bytes = 0  # of elementwise_bytes, those written by exp/log/erf-like operations
        self.kernels = 0  # operations that launch a kernel (not views, not bare allocations)
        # The measured step's matmul and attention FLOPs, by torch's formulas (torch.utils.flop_counter), where asked
        self.flops: dict[str, float] | None = None
        # Shapes of the trainable parameters that receive more than one gradient (a tied head's), and whether
        # autograd is now summing a node's outputs into the gradients waiting for their nodes (see `_sums_in_place`).
        self.shared_shapes: set[tuple[tuple[int, ...], Any]] = set()
        self.summing = False
        # With `reader` (a trace at marker dimensions, see symbols.py) every quantity summed above is also
        # kept as a polynomial: one term per tensor added, read from its size.
        self.reader: Callable[[int], Any] | None = None
        self.terms: dict[str, list[Any]] = {}
        self.unread = 0  # quantities the reader found no reading for

    def add(self, quantity: str, values: list[Any]) -> None:
        """Add `values` (one per tensor or operation: ints, or Capped lookups) to the running total
        `quantity`. With a reader, a Capped value is kept as the pair of its readings, in `<quantity>_capped`."""
        if quantity in SUMMED:
            setattr(self, quantity, getattr(self, quantity) + sum(int(value) for value in values))
        if self.reader is None:
            return
        for value in values:
            if isinstance(value, Capped):
                pair = [[self.reader(n) for n in value.operand], [self.reader(n) for n in value.output]]
                if any(poly is None for side in pair for poly in side):
                    self.unread += 1
                else:
                    self.terms.setdefault(f"{quantity}_capped", []).append(pair)
                continue
            poly = self.reader(int(value))
            if poly is None:
                self.unread += 1
            else:
                self.terms.setdefault(quantity, []).append(poly)

    def track(self, tensor: Any, category: str | None = None) -> int:
        """Record a tensor's storage if it is new; returns the bytes newly allocated (0 if seen)."""
        storage = tensor.untyped_storage()
        if self.closed or id(storage) in self._keys:
            return 0
        key = self._next
        self._next += 1
        self._keys[id(storage)] = key
        self.events.append(Event(ALLOC, key, storage.nbytes(), category or self.category, self.phase, self.step))
        weakref.finalize(storage, self._free, id(storage))
        return int(storage.nbytes())

    def adopt(self, tensor: Any, source: Any) -> None:
        """`tensor` holds `source`'s memory from now on (autograd summed into `source` in place): no new
        allocation, and `source`'s storage going away frees nothing."""
        key = self._keys.pop(id(source.untyped_storage()), None)
        if self.closed or key is None:
            return
        storage = tensor.untyped_storage()
        self._keys[id(storage)] = key
        weakref.finalize(storage, self._free, id(storage))

    def _free(self, storage_id: int) -> None:
        key = self._keys.pop(storage_id, None)
        if key is not None and not self.closed:
            self.events.append(Event(FREE, key, phase=self.phase, step=self.step))

    def close(self) -> list[Event]:
        """The events so far; frees after this (the model being torn down, whenever that is) are not
        part of the step and would make traces of the same step differ."""
        self.closed = True
        return self.events

    def reclassify(self, tensor: Any, category: str) -> None:
        """Mark a tensor's storage as `category`. One the dispatch mode never saw (autograd creates some
        gradients, the embedding's among them, below the Python dispatcher) is recorded here."""
        if self.closed:
            return
        key = self._keys.get(id(tensor.untyped_storage()))
        if key is None:
            self.track(tensor, category)
        else:
            self.events.append(Event(RECLASS, key, category=category, phase=self.phase, step=self.step))


def _dispatch_mode(recorder: _Recorder) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            summed = 0  # bytes an in-place sum writes into memory it already holds (no allocation, still written)
            if recorder.summing:
                if func is torch.ops.aten.add.Tensor and _summed_in_place(recorder, args, kwargs or {}, out):
                    recorder.adopt(out, args[0])
                    summed = int(out.untyped_storage().nbytes())
                elif func.overloadpacket is not torch.ops.aten.add and _launches_kernel(func):
                    recorder.summing = False
            written = [nbytes for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)
                       if (nbytes := recorder.track(leaf))] + ([summed] if summed else [])
            if not (recorder.counting or recorder.counting_optimizer):
                return out
            kernel = _launches_kernel(func)
            if recorder.counting_optimizer and kernel:
                recorder.add("optimizer_bytes", moved_parts(func, args, kwargs or {}, out))
            if recorder.counting:
                name = func.overloadpacket.__name__
                if name not in _COMPUTE_OPS:
                    recorder.add("elementwise_bytes", written)
                    if kernel:
                        recorder.add("moved_bytes", moved_parts(func, args, kwargs or {}, out))
                if name.startswith(_TRANSCENDENTAL_OPS):
                    recorder.add("transcendental_bytes", written)
                if name.startswith(_RANDOM_OPS):
                    recorder.add("random_elements", [leaf.numel() for leaf in tree_leaves(out)
                                                     if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()])
                if kernel:
                    recorder.add("kernels", [1])
                _count_flops(recorder, func, args, kwargs or {}, out)
            return out

    return Recording()


def _count_flops(recorder: _Recorder, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """An operation's FLOPs by torch's formula for it (FlopCounterMode's registry; none for the rest), as attention
    or matmul, where the recorder counts them; with a reader, also kept as a term. Counted as the step runs:
    FlopCounterMode itself tracks modules with hooks that keep tensors alive, which would change what checkpointing
    frees, and would take a pass of its own."""
    if recorder.flops is None:
        return
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return
    count = formula(*args, **kwargs, out_val=out)
    kind = "attention" if func.overloadpacket.__name__ in _ATTENTION_OPS else "matmul"
    recorder.flops[kind] += count
    if recorder.reader is not None:
        recorder.add(f"flops_{kind}", [int(count)])


def _summed_in_place(recorder: _Recorder, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether this addition is autograd summing a second gradient into a parameter's first, which on real
    tensors it does in place (torch/csrc/autograd/input_buffer.cpp `accumulate`: when the first gradient is a
    dense, contiguous tensor nothing else holds) and under a dispatch mode out of place. A view (the transposed
    gradient of `F.linear`'s weight) is summed out of place on real tensors too."""
    import torch

    first = args[0] if args else None
    return (isinstance(first, torch.Tensor) and len(args) == 2 and not kwargs
            and (tuple(out.shape), out.dtype) in recorder.shared_shapes
            and first.shape == out.shape and first.dtype == out.dtype
            and not first._is_view() and first.is_contiguous())


@contextmanager
def _sums_in_place(loss: Any, recorder: _Recorder) -> Iterator[None]:
    """While `loss.backward()` runs: mark when autograd sums a node's outputs into the gradients waiting for
    the nodes they go to, for the trainable parameters that receive more than one gradient (tied weights).

    A parameter's gradients meet in the input buffer of its AccumulateGrad node; the engine adds each node's
    outputs into those buffers after the node's post hooks ran and before the next node's pre hooks. Models with
    no such parameter get no hooks."""
    import torch

    nodes: list[Any] = []
    incoming: dict[Any, int] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                incoming[child] = incoming.get(child, 0) + 1
                stack.append(child)
    # parameters only: a leaf made to require gradients (the embeddings' output, for checkpointing frozen embeddings)
    # is summed out of place here as before, which the shipped templates were traced with
    shared = [node for node, count in incoming.items()
              if count > 1 and isinstance(getattr(node, "variable", None), torch.nn.Parameter)]
    if not shared:
        yield
        return
    recorder.shared_shapes = {(tuple(node.variable.shape), node.variable.dtype) for node in shared}

    def open_window(grad_inputs: Any, grad_outputs: Any) -> None:
        recorder.summing = True

    def close_window(grad_outputs: Any) -> None:
        recorder.summing = False

    handles = [node.register_prehook(close_window) for node in nodes]
    handles += [node.register_hook(open_window) for node in nodes
                if any(child in shared for child, _ in node.next_functions)]
    try:
        yield
    finally:
        recorder.summing = False
        recorder.shared_shapes = set()
        for handle in handles:
            handle.remove()


def _launches_kernel(func: Any) -> bool:
    """Views relabel memory, bare allocations only reserve it, and prim:: operations (a tensor's device, its
    layout) are queries answered without a kernel."""
    return not func.is_view and func.namespace != "prim" and func.overloadpacket.__name__ not in _NO_KERNEL_OPS


def _tensor_bytes(tensor: Any) -> int:
    """Bytes a kernel touches reading `tensor`: its elements, or its storage when that is smaller (a broadcast
    operand expanded with stride 0 is read once)."""
    return int(min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes()))


def moved_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes an eager kernel reads and writes: every tensor operand it reads, every tensor it mutates in place
    (the operator schema says which), and every new tensor it returns. Lookups (embedding, gather, the loss's
    pick of each target's log-probability) read only as much of their table as they write; an operand used
    only for its shape (`zeros_like`, the target of `copy_` or `fill_`) is not read."""
    return sum(int(part) for part in moved_parts(func, args, kwargs, out))


def moved_parts(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[int | Capped]:
    """The terms of `moved_bytes`, one per tensor read or written (a lookup's read as a Capped pair)."""
    import torch
    from torch.utils._pytree import tree_leaves

    name = func.overloadpacket.__name__
    schema = func._schema
    parts: list[int | Capped] = []
    shape_only = _SHAPE_ONLY_ARGUMENT.get(name)
    outputs = [_tensor_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    for index, argument in enumerate(schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        sizes = [_tensor_bytes(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        mutated = argument.alias_info is not None and argument.alias_info.is_write
        if mutated:
            parts += sizes
        if index == shape_only:
            continue
        if name in _LOOKUP_OPS and sizes:
            parts.append(Capped(tuple(sizes), tuple(outputs)))  # reads at most as much of its table as it writes
        else:
            parts += sizes
    for value, returned in zip(out if isinstance(out, tuple) else (out,), schema.returns, strict=False):
        if returned.alias_info is None:  # a new tensor, not an operand returned again
            parts += [_tensor_bytes(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return [part for part in parts if part]


@dataclass(frozen=True)
class Capped:
    """A lookup's read: the bytes of its operand, at most the bytes it writes (`int()` gives the figure)."""

    operand: tuple[int, ...]
    output: tuple[int, ...]

    def __int__(self) -> int:
        return min(sum(self.operand), sum(self.output))

    def __bool__(self) -> bool:
        return int(self) > 0


def _fakeify(model: Any, mode: Any) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape and dtype, then
    re-tie tied weights (replacing them one by one would give a tied head its own copy)."""
    import torch

    with mode:
        for module in model.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    fake = torch.empty(parameter.shape, dtype=parameter.dtype, device="cpu")
                    module._parameters[name] = torch.nn.Parameter(fake, requires_grad=parameter.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "tie_word_embeddings", False):
        head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
        if head is not None and embedding is not None and head.weight.shape == embedding.weight.shape:
            head.weight = embedding.weight


def build_training_model(config_data: dict[str, Any], settings: TraceSettings) -> Any:
    """The model exactly as it is trained (dtype, adapters, checkpointing), on the meta device."""
    from tunecast.step.setup import param_dtype, prepare_for_training, training_config
    from tunecast.step.shape import build_meta_model

    model = build_meta_model(training_config(config_data), dtype=param_dtype(settings.precision),
                             attention=settings.attention)
    return prepare_for_training(model, settings)


def _linear_shape(module: Any) -> tuple[int, int, bool] | None:
    """(in, out, weight trains) of a Linear layer, or of GPT-2's Conv1D (a Linear with its weight transposed)."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, bool(module.weight.requires_grad)
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        inputs, outputs = module.weight.shape
        return int(inputs), int(outputs), bool(module.weight.requires_grad)
    return None


def model_facts(model: Any, settings: TraceSettings) -> ModelFacts:
    import torch

    from tunecast.step.setup import param_dtype

    parts = fact_parts(model)
    element = torch.empty((), dtype=param_dtype(settings.precision)).element_size()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return facts_from_parts(parts, attention=str(base.config._attn_implementation), param_dtype_bytes=element)


def fact_parts(model: Any) -> dict[str, list[Any]]:
    """The numbers ModelFacts is made of: the element counts of the frozen decoder Linear weights, of the
    trainable tensors, of the first layer's parameters (with their element sizes), the first layer's Linear
    shapes and the output head's."""
    import torch

    from tunecast.step.setup import decoder_layers

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = decoder_layers(model)
    quantizable = []
    for layer in layers:
        for module in layer.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and weight is not None and not weight.requires_grad:
                quantizable.append(weight.numel())
    first = list(layers[0].parameters()) if layers else []
    head = base.get_output_embeddings()
    head_linear = [head.in_features, head.out_features, bool(head.weight.requires_grad)] \
        if isinstance(head, torch.nn.Linear) else [0, 0, False]
    return {
        "quantizable": quantizable,
        "trainable": [p.numel() for p in model.parameters() if p.requires_grad],
        "layer": [[p.numel(), p.element_size()] for p in first],
        "linears": [list(shape) for m in (layers[0].modules() if layers else ()) if (shape := _linear_shape(m))],
        "head": head_linear,
    }


def facts_from_parts(parts: dict[str, list[Any]], *, attention: str, param_dtype_bytes: int) -> ModelFacts:
    quantizable, trainable = parts["quantizable"], parts["trainable"]
    return ModelFacts(
        attention=attention,
        quantizable_numel=sum(quantizable),
        largest_quantizable_numel=max(quantizable, default=0),
        trainable_numel=sum(trainable),
        trainable_small_numel=sum(n for n in trainable if n < SMALL_TENSOR_NUMEL),
        trainable_tensors=len(trainable),
        layer_numel=sum(n for n, _ in parts["layer"]),
        layer_bytes=sum(n * size for n, size in parts["layer"]),
        param_dtype_bytes=param_dtype_bytes,
        layer_linears=tuple((int(a), int(b), bool(t)) for a, b, t in parts["linears"]),
        head_linear=(int(parts["head"][0]), int(parts["head"][1]), bool(parts["head"][2])),
    )


# Operations whose time is their arithmetic (counted as FLOPs); the rest move memory.
_COMPUTE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
# Operations that allocate or relabel memory without launching a kernel.
_NO_KERNEL_OPS = {"empty", "empty_strided", "empty_like", "_unsafe_view", "lift_fresh", "alias", "set_",
                  "resize_", "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
# Elementwise operations whose arithmetic (exp, log, erf, tanh) rather than their memory traffic can set their
# pace on a CPU: activations, softmax, the loss, normalisation's reciprocal square root.
_TRANSCENDENTAL_OPS = ("exp", "log", "_log_softmax", "_softmax", "softmax", "gelu", "silu", "tanh", "sigmoid",
                       "erf", "rsqrt", "pow", "_safe_softmax")
# Operations that draw random numbers (dropout's masks).
_RANDOM_OPS = ("bernoulli", "native_dropout", "rand", "uniform", "normal")
# Operations that read only the rows of a table they write (each operand's read capped at the output's size).
_LOOKUP_OPS = {"embedding", "index_select", "gather", "index", "take", "nll_loss_forward", "nll_loss2d_forward"}
# Operations with an operand (by position) that gives only a shape, or is overwritten without being read.
_SHAPE_ONLY_ARGUMENT = {"zeros_like": 0, "ones_like": 0, "full_like": 0, "rand_like": 0, "randn_like": 0,
                        "new_zeros": 0, "new_ones": 0, "new_full": 0, "new_empty": 0, "copy_": 0, "fill_": 0,
                        "zero_": 0, "normal_": 0, "uniform_": 0, "bernoulli_": 0, "random_": 0,
                        "nll_loss_backward": 1, "nll_loss2d_backward": 1}
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention_for_cpu_backward")


def _register_attention_flops() -> None:
    """torch's FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel the trace runs
    through, and counts attention as if every score were needed. Register the CPU kernel with torch's own
    formulas (the backward recomputes the scores), halved when causal: the kernels skip masked blocks."""
    import torch
    from torch.utils import flop_counter

    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if forward_op in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(forward_op)
    def forward(query: Any, key: Any, value: Any, dropout: float = 0.0, is_causal: bool = False,
                *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        flops = flop_counter.sdpa_flop_count(query, key, value)
        return flops // 2 if is_causal else flops

    @flop_counter.register_flop_formula(backward_op)
    def backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout: float = 0.0,
                 is_causal: bool = False, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        flops = flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)
        return flops // 2 if is_causal else flops


@contextmanager
def _as_on_real_tensors() -> Iterator[None]:
    """Make transformers' mask code take the path it takes on real tensors.

    transformers treats a FakeTensor as a sign of graph tracing and then always builds a (b, 1, s, s) causal
    mask — which on real tensors it skips for SDPA (passing `is_causal`), and whose presence also turns off
    SDPA's grouped-query path (keys and values get repeated to every head). The traced batches are unpadded
    and unpacked, so the real-tensor answers are known: not tracing, and no packed sequences.
    """
    try:
        import transformers.masking_utils as masking
        from transformers.utils.import_utils import is_tracing
    except ImportError:  # pragma: no cover - older transformers have no masking_utils
        yield
        return
    saved = {name: getattr(masking, name) for name in ("is_tracing", "find_packed_sequence_indices")
             if hasattr(masking, name)}
    if "is_tracing" in saved:
        masking.is_tracing = lambda tensor=None: is_tracing(None)
    if "find_packed_sequence_indices" in saved:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        with _grouped_mm_in_any_dtype():
            yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


@contextmanager
def _grouped_mm_in_any_dtype() -> Iterator[None]:
    """Let the fake kernel of `torch._grouped_mm` take float32 and float16 operands, as its real kernels do.

    transformers runs a mixture of experts' experts through the grouped matmul in the weights' dtype (its
    `integrations/moe.py` casts the input to it; the op is not autocast-enabled). The real kernels take any
    float dtype: the CPU kernel, and on CUDA (torch >= 2.9) `_grouped_mm_fallback` wherever the operands are not
    bf16, a loop of `mm_out` into the one output tensor (aten/src/ATen/native/cuda/GroupedBlas.cpp,
    GroupedMMUtils.h). The fake kernel (torch/_meta_registrations.py `_meta_grouped_mm_common`) checks for the
    bf16 fast path only, so a step with float32 experts (fp32, or mixed precision's fp32 master weights) would not
    trace at all. The output it allocates is the same tensor either way: the operands' shape rule, in `out_dtype`
    or the first operand's dtype. Scaled (fp8) grouped matmuls keep torch's own checks."""
    try:
        import torch
        import torch._meta_registrations as meta
    except ImportError:  # pragma: no cover - depends on the torch build
        yield
        return
    common = getattr(meta, "_meta_grouped_mm_common", None)
    create = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if common is None or create is None:  # pragma: no cover - a torch without the grouped matmul
        yield
        return
    floats = (torch.float32, torch.float16)

    def any_dtype(mat_a: Any, mat_b: Any, scale_a: Any, scale_b: Any, offs: Any = None, bias: Any = None,
                  scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False) -> Any:
        if scale_a is None and scale_b is None and mat_a.dtype in floats and mat_b.dtype == mat_a.dtype:
            torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                         lambda: "the grouped matmul's output dtype must be its operands' outside bf16")
            return create(mat_a, mat_b, offs, out_dtype)
        return common(mat_a, mat_b, scale_a, scale_b, offs=offs, bias=bias, scale_result=scale_result,
                      out_dtype=out_dtype, use_fast_accum=use_fast_accum)

    meta._meta_grouped_mm_common = any_dtype
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = common


@contextmanager
def _no_gc() -> Iterator[None]:
    """Frees happen at refcount zero only, so that every trace of a step has the same event order."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The recorder of the step being traced, for the loss stand-in of a step template (step/loss.py SegmentStub).
_ACTIVE: _Recorder | None = None
SEGMENT_MARK = "segment:"  # the category of a RECLASS event (key -1) that marks where a stand-in loss ran


@contextmanager
def _active(recorder: _Recorder) -> Iterator[None]:
    from tunecast.step import observer

    global _ACTIVE
    _ACTIVE = recorder
    observer.OBSERVER = _Observer()
    try:
        yield
    finally:
        _ACTIVE = None
        observer.OBSERVER = None


class _Observer:
    """What the loss stand-in of a traced step reports to (step/observer.py): this module's functions."""

    def segment_mark(self, part: str, stub: str, inputs: Any, weight: Any, bias: Any, targets: Any,
                     grad: Any) -> None:
        segment_mark(part, stub, inputs, weight, bias, targets, grad)

    def uncounted(self) -> Any:
        return uncounted()

    def head_called(self) -> None:
        head_called()

    def mark_accumulation(self, name: str, parameter: Any) -> None:
        mark_accumulation(name, parameter)


def _key(recorder: _Recorder, tensor: Any) -> int | None:
    return None if tensor is None else recorder._keys.get(id(tensor.untyped_storage()))


def segment_mark(part: str, stub: str, inputs: Any, weight: Any, bias: Any, targets: Any, grad: Any) -> None:
    """Mark where a stand-in loss runs in the traced step (`part`: its forward or backward pass), with what an
    estimate needs to trace the real loss in its place (estimate/compose.py): the keys of the tensors it takes,
    their dtypes, whether the head trains, the autocast in force and the category allocations are counted as."""
    import json

    import torch

    recorder = _ACTIVE
    if recorder is None or recorder.closed:
        return
    device = weight.device.type
    info = {"part": part, "stub": stub, "inputs": _key(recorder, inputs), "targets": _key(recorder, targets),
            "grad": _key(recorder, grad), "category": recorder.category,
            "inputs_dtype": str(getattr(inputs, "dtype", None)),
            "weight_dtype": str(weight.dtype), "trains": bool(weight.requires_grad), "bias": bias is not None,
            "bias_trains": bool(bias is not None and bias.requires_grad),
            "autocast": str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None}
    recorder.events.append(Event(RECLASS, -1, category=SEGMENT_MARK + json.dumps(info, sort_keys=True),
                                 phase=recorder.phase, step=recorder.step))


def mark_accumulation(name: str, parameter: Any) -> None:
    """Mark, once, the events of `parameter`'s gradient accumulation (its AccumulateGrad node and the hooks
    on it): a composition moves them to where the real loss completes that gradient (compose.py)."""
    import json

    recorder = _ACTIVE
    if recorder is None:
        return

    def mark(part: str) -> None:
        if not recorder.closed:
            recorder.events.append(Event(RECLASS, -1, category=SEGMENT_MARK + json.dumps({"part": f"{part}:{name}"}),
                                         phase=recorder.phase, step=recorder.step))

    def started(grad: Any) -> None:
        mark("accumulate-start")

    def ended(tensor: Any) -> None:
        mark("accumulate-end")
        for handle in handles:
            handle.remove()

    handles = [parameter.register_hook(started), parameter.register_post_accumulate_grad_hook(ended)]


@contextmanager
def uncounted() -> Iterator[None]:
    """Operations whose written bytes and kernels the traced step does not count (a stand-in's)."""
    recorder = _ACTIVE
    if recorder is None:
        yield
        return
    counting, recorder.counting = recorder.counting, False
    try:
        yield
    finally:
        recorder.counting = counting


def head_called() -> None:
    """What the output head's forward pre-hook does in a traced step: later allocations are temporaries."""
    if _ACTIVE is not None:
        _ACTIVE.category = "temporaries"


@dataclass(frozen=True)
class SegmentTrace:
    """A loss traced alone (trace_segment): its events in each pass, keyed by its own recorder."""

    forward: list[Event]
    deferred: list[Event]  # frees as the forward pass leaves autocast (its cache of cast weights)
    backward: list[Event]
    result: int  # key of the summed loss the forward pass returns
    grads: tuple[int | None, ...]  # keys of the gradients it returns: the inputs', the head weight's and bias'
    accumulated: dict[str, int]  # where (an index into backward) the head's weight and bias gradients are complete
    views: dict[str, bool]  # whether each gradient it returns is a view (autograd sums a view out of place)
    externals: dict[int, str]  # keys of tensors the step holds outside the loss: "inputs", "targets", "grad"
    sums: dict[str, float] | None  # the figures trace_step sums over a counted pass (bytes written and moved,
    # kernels); None for a loss evaluated from its form (forms.py), which holds no figures


def _torch_dtype(name: str) -> Any:
    """A dtype as a mark writes it ("torch.bfloat16")."""
    import torch

    return getattr(torch, name.removeprefix("torch."))


def _loss_head(hidden: int, vocab: int, weight_dtype: str, trains: bool, bias: bool, bias_trains: bool) -> Any:
    """The output head a loss traced alone takes, as the step's (under the caller's FakeTensorMode)."""
    import torch

    head = torch.nn.Linear(hidden, vocab, bias=bias, dtype=_torch_dtype(weight_dtype))
    head.weight.requires_grad_(trains)
    if head.bias is not None:
        head.bias.requires_grad_(bias_trains)
    return head


def trace_segment(variant: str, *, inputs_shape: tuple[int, ...], inputs_dtype: str, targets_shape: tuple[int, ...],
                  hidden: int, vocab: int, weight_dtype: str, trains: bool, bias: bool, bias_trains: bool,
                  autocast: str | None, category: str, backward_category: str, softcap: float | None,
                  compiled: bool, once: bool = False, chunks: Chunks | None = None) -> SegmentTrace:
    """Trace the loss `variant` (step/loss.py SEGMENT_LOSSES) alone on fake tensors of the real size, as it runs
    in a traced step: its inputs held by the step, its result's gradient made by the step's backward pass. `once`:
    its repeated chunks run once (step/observer.py REPEATS_ONCE), for its memory alone. `chunks`: the chunks it
    runs, where not the runner's own (a form's read at marker lengths, forms.py)."""
    from tunecast.step import observer

    observer.REPEATS_ONCE = once
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _trace_segment(variant, inputs_shape, inputs_dtype, targets_shape, hidden, vocab, weight_dtype,
                                  trains, bias, bias_trains, autocast, category, backward_category, softcap, compiled,
                                  chunks)
    finally:
        observer.REPEATS_ONCE = False


def _trace_segment(variant: str, inputs_shape: tuple[int, ...], inputs_dtype: str, targets_shape: tuple[int, ...],
                   hidden: int, vocab: int, weight_dtype: str, trains: bool, bias: bool, bias_trains: bool,
                   autocast: str | None, category: str, backward_category: str, softcap: float | None,
                   compiled: bool, chunks: Chunks | None) -> SegmentTrace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunecast.step.loss import segment_total

    _TRACED_BEFORE[0] = True
    cast = _torch_dtype(autocast) if autocast is not None else None
    recorder = _Recorder()
    mode = FakeTensorMode()
    with mode, _no_gc():
        head = _loss_head(hidden, vocab, weight_dtype, trains, bias, bias_trains)
        head.register_forward_pre_hook(lambda module, args: setattr(recorder, "category", "temporaries"))
        base = torch.empty(inputs_shape, dtype=_torch_dtype(inputs_dtype), requires_grad=True)
        for tensor in (head.weight, head.bias, base):  # the step's tensors: views of them allocate nothing
            if tensor is not None:
                recorder.track(tensor)
        recorder.phase, recorder.category = "forward", category
        with _dispatch_mode(recorder):
            inputs = base.clone()  # the step's tensors: their allocation is the step's, their free may be the loss's
            # the step's targets: for the hidden states, its shifted labels, a view past the first of b × (s + 1)
            targets = torch.zeros(targets_shape, dtype=torch.long) if len(targets_shape) == 1 else \
                torch.zeros((targets_shape[0], targets_shape[1] + 1), dtype=torch.long)[:, 1:]
        externals: dict[int, str] = {_key(recorder, inputs): "inputs", _key(recorder, targets): "targets"}  # type: ignore[dict-item]
        start = len(recorder.events)
        with _dispatch_mode(recorder), torch.autocast("cpu", dtype=cast, enabled=cast is not None):
            recorder.counting = True
            result = segment_total(variant, inputs, head, targets, softcap, compiled=compiled, chunks=chunks)
            recorder.counting = False
            forward_end = len(recorder.events)
        deferred_end = len(recorder.events)
        result_key = _key(recorder, result)
        root = result * 2.0  # untracked: what the step does with the loss; its backward makes the loss's gradient
        wanted = {"inputs": inputs, **({"weight": head.weight} if trains else {}),
                  **({"bias": head.bias} if bias_trains else {})}
        captured: dict[str, int | None] = {}
        at: dict[str, int] = {}
        views: dict[str, bool] = {}
        bounds = {"start": 0, "end": 0, "wanted": len(wanted)}

        def grad_in(grad: Any) -> None:
            externals[_key(recorder, grad)] = "grad"  # type: ignore[index]
            bounds["start"] = len(recorder.events)
            recorder.counting = True

        def grad_out(name: str) -> Callable[[Any], None]:
            def hook(grad: Any) -> None:
                captured[name] = _key(recorder, grad)
                at[name] = len(recorder.events)
                views[name] = bool(grad._is_view())
                if len(captured) == bounds["wanted"] and not bounds["end"]:
                    bounds["end"] = len(recorder.events)
                    recorder.counting = False
            return hook

        handles = [result.register_hook(grad_in), *(tensor.register_hook(grad_out(name))
                                                     for name, tensor in wanted.items())]
        del inputs, targets, result, wanted
        recorder.phase, recorder.category = "backward", backward_category
        with _dispatch_mode(recorder), _sums_in_place(root, recorder):
            root.backward()
        events = recorder.close()
        for handle in handles:
            handle.remove()
        sums = {name: float(getattr(recorder, name)) for name in SUMMED}
    return SegmentTrace(events[start:forward_end], [e for e in events[forward_end:deferred_end] if e.kind == FREE],
                        events[bounds["start"]:bounds["end"]], int(result_key),  # type: ignore[arg-type]
                        (captured.get("inputs"), captured.get("weight"), captured.get("bias")),
                        {name: index - bounds["start"] for name, index in at.items() if name != "inputs"}, views,
                        externals, sums)


def segment_flops(variant: str, *, inputs_shape: tuple[int, ...], inputs_dtype: str, targets_shape: tuple[int, ...],
                  hidden: int, vocab: int, weight_dtype: str, trains: bool, bias: bool, autocast: str | None,
                  softcap: float | None, compiled: bool) -> dict[str, float]:
    """The matmul and attention FLOPs of the loss `variant`'s forward and backward pass at that size, counted as
    trace_step counts a step's (`_count_flops`), in a pass of their own: a composed step's figures ask for them, a
    limit's checks do not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunecast.step.loss import segment_total

    cast = _torch_dtype(autocast) if autocast is not None else None
    recorder = _Recorder()
    recorder.flops = {"matmul": 0.0, "attention": 0.0}
    with warnings.catch_warnings(), FakeTensorMode(), _no_gc():
        warnings.simplefilter("ignore")
        head = _loss_head(hidden, vocab, weight_dtype, trains, bias, bias_trains=False)
        inputs = torch.empty(inputs_shape, dtype=_torch_dtype(inputs_dtype), requires_grad=True)
        with _dispatch_mode(recorder):
            recorder.counting = True
            with torch.autocast("cpu", dtype=cast, enabled=cast is not None):
                loss = segment_total(variant, inputs, head, torch.zeros(targets_shape, dtype=torch.long), softcap,
                                     compiled=compiled)
            loss.backward()
    return dict(recorder.flops)


def trace_step(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int, *,
               count_flops: bool = True, reader: Callable[[int], Any] | None = None) -> Trace:
    """Two training steps of `config_data`'s model at micro-batch `batch`, length `seq`; with `count_flops`
    `flops` holds the second step's matmul and attention FLOPs (its forward and backward passes).
    With `reader` (for a model at marker dimensions) every summed figure also keeps its terms."""
    with warnings.catch_warnings():
        # Deprecation notices of the libraries traced through are for their maintainers, not our users.
        warnings.simplefilter("ignore")
        return _trace_step(config_data, settings, batch, seq, count_flops, reader)


def optimizer_step(recorder: _Recorder, optimizer: Any, step: int) -> None:
    """The optimizer's step after a traced step's backward pass (none where it steps in the backward pass): its
    states are the optimizer's; the gradients are then dropped."""
    import torch

    recorder.counting = False
    recorder.phase = "optimizer"
    recorder.counting_optimizer = step == STEPS
    if optimizer is not None:
        optimizer.step()
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    recorder.reclassify(value, "optimizer")
        optimizer.zero_grad(set_to_none=True)
    recorder.counting_optimizer = False
    recorder.phase = "setup"


def _trace_step(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int,
                count_flops: bool, reader: Callable[[int], Any] | None) -> Trace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunecast.step.forward import forward_backward
    from tunecast.step.setup import make_optimizer

    _TRACED_BEFORE[0] = True
    _register_attention_flops()
    model = build_training_model(config_data, settings)
    facts = model_facts(model, settings)
    mode = FakeTensorMode()
    _fakeify(model, mode)
    recorder = _Recorder()
    recorder.reader = reader
    recorder.flops = {"matmul": 0.0, "attention": 0.0} if count_flops else None
    if reader is not None:
        parts = fact_parts(model)
        for name in ("quantizable", "trainable"):
            recorder.terms[f"fact_{name}"] = [reader(n) for n in parts[name]]
        recorder.terms["fact_layer"] = [[reader(n), size] for n, size in parts["layer"]]
        recorder.terms["fact_linears"] = [[reader(a), reader(b), t] for a, b, t in parts["linears"]]
        recorder.terms["fact_head"] = [reader(parts["head"][0]), reader(parts["head"][1]), parts["head"][2]]
    params = [p for p in model.parameters() if p.requires_grad]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    head_hook = head.register_forward_pre_hook(lambda module, args: setattr(recorder, "category", "temporaries"))

    for parameter in model.parameters():
        recorder.track(parameter, "trainable_weights" if parameter.requires_grad else "weights")
    for buffer in model.buffers():
        recorder.track(buffer, "weights")

    if settings.optimizer_in_backward:
        optimizers = {p: make_optimizer(settings.optimizer, [p]) for p in params}

        def step_in_backward(parameter: Any) -> None:
            optimizers[parameter].step()
            for state in optimizers[parameter].state[parameter].values():
                if isinstance(state, torch.Tensor):
                    recorder.reclassify(state, "optimizer")
            parameter.grad = None

        hooks = [p.register_post_accumulate_grad_hook(step_in_backward) for p in params]
        optimizer = None
    else:
        def mark_gradient(parameter: Any) -> None:
            recorder.reclassify(parameter.grad, "gradients")

        hooks = [p.register_post_accumulate_grad_hook(mark_gradient) for p in params]
        optimizer = make_optimizer(settings.optimizer, params)

    def to_backward() -> None:
        recorder.phase, recorder.category = "backward", "temporaries"

    def backward(loss: Any) -> None:
        with _sums_in_place(loss, recorder):
            loss.backward()

    try:
        with mode, _as_on_real_tensors(), _no_gc(), _dispatch_mode(recorder), _active(recorder):
            recorder.category = "activations"
            input_ids = torch.zeros((batch, seq), dtype=torch.long)
            labels = torch.zeros((batch, seq), dtype=torch.long)
            for step in range(1, STEPS + 1):
                recorder.step = step
                recorder.phase, recorder.category = "forward", "activations"
                recorder.counting = step == STEPS
                forward_backward(model, input_ids, labels, precision=settings.precision,
                                 chunked_loss=settings.loss == "chunked", on_backward=to_backward,
                                 backward=backward, runner_step=settings.runner_step)
                optimizer_step(recorder, optimizer, step)
            events = recorder.close()
    finally:
        head_hook.remove()
        for hook in hooks:
            hook.remove()
    flops = dict(recorder.flops) if recorder.flops is not None else {}
    sums = {name: float(getattr(recorder, name)) for name in SUMMED}
    return Trace(events, facts, {**flops, **sums}, recorder.terms, recorder.unread)
