"""Strict device mode: on a CPU machine, fail every ``torch.distributed`` collective that would hand
a host tensor to NCCL on a GPU machine.

On a GPU machine the process groups use NCCL, which only takes GPU tensors; CPU CI runs gloo,
which takes host tensors everywhere, so code that builds a collective's tensor on the host (a
``torch.zeros(())`` without a device, a ``.cpu()`` result) passes CI and crashes at the first
step on GPUs. On CPU every tensor is on ``"cpu"``, so this mode EMULATES where each tensor would
live on a GPU machine and checks collectives against that.

What is emulated (:class:`HostTrackingMode`, a torch function mode): tensors that would be on the
host on a GPU machine carry a Python attribute (``_tw_host``), the ``file:line`` where their
host-ness began. The rules mirror CUDA placement:

* a tensor factory (``torch.zeros``, ``ones``, ``empty``, ``full``, ``tensor``, ``as_tensor``,
  ``arange``, ``linspace``, ``rand``, ``randn``, ``randint``, ``eye``, ``scalar_tensor`` ...)
  called without a device and without tensor inputs -> host. An explicit ``device`` (``"cpu"``,
  ``torch.device("cpu")``, ``"cuda"``, an int) -> not host: on CPU runs the runtime passes its
  device explicitly (``torch.device("cpu")`` here, CUDA on GPUs) and the CPU shims of
  :mod:`launcher.engines.compat` map ``device="cuda"`` to the host. Except the ``.device`` of a
  host tensor (the object that access returned, for its last 256 accesses): ``device=host.device``
  -> host, as on a GPU machine.
* ``Tensor.cpu()`` -> host (a CPU tensor's ``.cpu()`` is itself, so the mode returns an alias of
  it, tagged, and leaves the original alone). ``Tensor.to(device)`` / ``Tensor.cuda()`` -> not
  host (a no-op ``.to`` returns the same object, whose tag is then cleared: a false negative);
  ``.to(other)`` -> ``other``'s placement; ``.to(host.device)`` -> host; ``.to(dtype)`` ->
  unchanged. (A move to the host that returns its input on CPU returns a tagged alias.)
* any other op returning tensors (``*_like``, ``new_*``, views, arithmetic, ``torch.stack``):
  host iff it had tensor inputs (arguments, keyword arguments and the items of list/tuple
  arguments) and all of them are host (on CUDA a 0-dim host tensor mixed with a GPU tensor gives a
  GPU tensor). An op returning one of its own inputs (in-place ops, ``out=``, a no-op
  ``contiguous()``) leaves that tensor's placement as it was: in-place ops never move a tensor.
  ``t.data = other`` and ``t.set_(other)`` give ``t`` the placement of ``other``.
* an untagged tensor counts as not host.

What is checked: the tensor collectives of ``torch.distributed`` (``all_reduce``, ``all_gather``,
``broadcast``, ``send``/``recv``, ``batch_isend_irecv`` ...) are replaced by wrappers on the
``torch.distributed`` module (callers that look them up at call time, as the runtime,
Megatron-Core and DeepSpeed do, get the wrappers). Each group stands for the backend it would
have on GPUs: the default group and every group made by ``new_group`` / ``new_subgroups*`` without
``backend="gloo"`` are NCCL; groups asked for gloo (Megatron-Core makes some on purpose) are gloo
and unchecked. A host tensor handed to an NCCL group raises :class:`DeviceRuleError` naming where
it was created. Object collectives (``all_gather_object`` ...) pick their device themselves and
are not checked.

Blind spots (false negatives only; a tensor the mode does not see is never reported):
autograd backward (the engine clears the torch function mode stack, so gradients and
recomputed activations are untagged), threads other than the one that called :func:`install`,
``torch.from_numpy`` / ``frombuffer`` / legacy constructors (no torch function dispatch),
tensors created before :func:`install`, functional collectives, and callers that bound a
collective before :func:`install` (``from torch.distributed import all_reduce``). Groups made
before :func:`install` count as NCCL even if they are gloo, so install before creating groups.

Opt-in: set ``TRAINWRIGHT_STRICT_DEVICES=1`` and call :func:`install_if_requested` at process
start, after :func:`launcher.engines.compat.install` (``install`` applies it first itself). On a
machine with CUDA the mode does nothing: the real NCCL does the checking there.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV_VAR = "TRAINWRIGHT_STRICT_DEVICES"
"""Set to 1 to make :func:`install_if_requested` install strict device mode."""

_TAG = "_tw_host"
_STATE: dict = {"mode": None}
_GLOO_GROUPS: "weakref.WeakSet" = weakref.WeakSet()
_HOST_DEVICES: dict = {}  # id -> a torch.device that host.device returned, newest last
_HOST_DEVICES_KEPT = 256

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep

_FACTORIES = frozenset(getattr(torch, name) for name in (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "asarray", "arange", "range",
    "linspace", "logspace", "rand", "randn", "randint", "randperm", "normal", "eye",
    "scalar_tensor", "empty_strided", "from_numpy", "frombuffer", "tril_indices", "triu_indices",
) if hasattr(torch, name))

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "_all_gather_base", "_reduce_scatter_base",
)
"""The ``torch.distributed`` functions whose tensors are checked (plus ``batch_isend_irecv``)."""


class DeviceRuleError(RuntimeError):
    """A collective on a group that is NCCL on GPU machines was handed a host tensor."""


def _origin() -> str:
    """``file:line`` of the innermost caller outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            if path.startswith(_REPO_ROOT):
                path = path[len(_REPO_ROOT):]
            elif "site-packages" + os.sep in path:
                path = path.split("site-packages" + os.sep, 1)[1]
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _set_tag(tensor, tag) -> None:
    """Give ``tensor`` placement ``tag`` (None: not host), touching it only when that changes."""
    if getattr(tensor, _TAG, None) != tag:
        try:
            setattr(tensor, _TAG, tag)
        except (AttributeError, TypeError):
            pass


def _inputs_tag(args, kwargs) -> tuple:
    """(had tensor inputs, the first input's tag if every tensor input is host else None)."""
    had, first = False, None
    for group in (args, kwargs.values()):
        for value in group:
            items = value if type(value) in (list, tuple) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor):
                    tag = getattr(item, _TAG, None)
                    if tag is None:
                        return True, None
                    had, first = True, first or tag
    return had, first


def _device_tag(device):
    """A tag if ``device`` is the ``.device`` of a host tensor (see :func:`_device_of`), else
    None: every other explicit device stands for the group's device."""
    if isinstance(device, torch.device) and _HOST_DEVICES.get(id(device)) is device:
        return _origin()
    return None


def _derived_tag(func, args, kwargs):
    """Placement of the tensors ``func`` returned, by the rules in the module docstring."""
    device = kwargs.get("device")
    if device is not None:
        return _device_tag(device)
    had, tag = _inputs_tag(args, kwargs)
    if had:
        return tag
    return _origin() if func in _FACTORIES else None


def _tag_outputs(func, out, args, kwargs) -> None:
    if isinstance(out, torch.Tensor):
        outs = (out,)
    elif isinstance(out, (tuple, list)) and not isinstance(out, torch.Size):
        outs = [o for o in out if isinstance(o, torch.Tensor)]
        if not outs:
            return
    else:
        return
    tag = _derived_tag(func, args, kwargs)
    self_ = args[0] if args else None
    out_kw = kwargs.get("out")
    for o in outs:
        if o is not self_ and o is not out_kw:  # in-place / out=: the tensor stays where it was
            _set_tag(o, tag)


def _moved(out, source, tag):
    """``out`` (a move of ``source``) tagged ``tag``. A move to the host returns a new tensor on a
    GPU machine but ``source`` itself on CPU: tag an alias then, never ``source``."""
    if tag is not None and out is source and getattr(source, _TAG, None) != tag:
        out = out.view_as(out)
    _set_tag(out, tag)
    return out


def _cpu(func, args, kwargs):
    return _moved(func(*args, **kwargs), args[0], _origin())


def _to(func, args, kwargs):
    out = func(*args, **kwargs)
    target = args[1] if len(args) > 1 else kwargs.get("other")
    if kwargs.get("device") is not None:
        tag = _device_tag(kwargs["device"])
    elif isinstance(target, torch.Tensor):
        tag = getattr(target, _TAG, None)
    elif target is None or isinstance(target, torch.dtype):
        tag = getattr(args[0], _TAG, None)
    else:
        tag = _device_tag(target)  # a device (str, torch.device, int)
    return _moved(out, args[0], tag)


def _device_of(func, args, kwargs):
    """``host.device``: remember the returned object (a new one per access), so that tensors
    created with ``device=host.device`` are host too, as they are on a GPU machine."""
    out = func(*args, **kwargs)
    if getattr(args[0], _TAG, None) is not None:
        _HOST_DEVICES[id(out)] = out
        if len(_HOST_DEVICES) > _HOST_DEVICES_KEPT:
            del _HOST_DEVICES[next(iter(_HOST_DEVICES))]
    return out


def _cuda(func, args, kwargs):
    out = func(*args, **kwargs)
    _set_tag(out, None)
    return out


def _take_source(func, args, kwargs):
    """``t.data = other`` / ``t.set_(other)``: ``t`` now lives where ``other`` does."""
    out = func(*args, **kwargs)
    source = args[1] if len(args) > 1 else kwargs.get("source")
    if isinstance(source, torch.Tensor):
        _set_tag(args[0], getattr(source, _TAG, None))
    elif source is not None:
        _set_tag(args[0], None)
    return out


_SPECIAL = {
    torch.Tensor.cpu: _cpu,
    torch.Tensor.to: _to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.set_: _take_source,
    torch.Tensor.data.__set__: _take_source,
    torch.Tensor.device.__get__: _device_of,
}


class HostTrackingMode(TorchFunctionMode):
    """Tags the tensors that would be on the host on a GPU machine (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        out = func(*args, **kwargs)
        _tag_outputs(func, out, args, kwargs)
        return out


def host_origin(tensor):
    """Where ``tensor`` became a host tensor (``file:line``), or None if it is not one."""
    return getattr(tensor, _TAG, None)


def real_backend(group) -> str:
    """The backend ``group`` has on a GPU machine: "gloo" if it was asked for, else "nccl"."""
    if group is not None and group in _GLOO_GROUPS:
        return "gloo"
    return "nccl"


def _record(group, backend) -> None:
    if backend is not None and "gloo" in str(backend).lower():
        try:
            _GLOO_GROUPS.add(group)
        except TypeError:  # GroupMember.NON_GROUP_MEMBER and other non-groups
            pass


def _tensors(args, kwargs):
    for group in (args, kwargs.values()):
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif type(value) in (list, tuple):
                yield from (v for v in value if isinstance(v, torch.Tensor))


def check(name: str, group, tensors) -> None:
    """Raise :class:`DeviceRuleError` if ``group`` is NCCL on GPUs and a tensor is host."""
    if real_backend(group) != "nccl":
        return
    for tensor in tensors:
        where = getattr(tensor, _TAG, None)
        if where is not None:
            raise DeviceRuleError(
                f"torch.distributed.{name} on a group whose backend on a GPU machine is NCCL got "
                f"a host (CPU) tensor created at {where}; NCCL only takes GPU tensors: create it "
                f"on the group's device (launcher.parallel.collectives.device_for(group)) or move "
                f"it there with .to(device)")


def _param_index(func, name: str):
    params = list(inspect.signature(func).parameters)
    return params.index(name) if name in params else None


def _checked(name: str, original):
    index = _param_index(original, "group")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if "group" in kwargs:
            group = kwargs["group"]
        else:
            group = args[index] if index is not None and len(args) > index else None
        check(name, group, _tensors(args, kwargs))
        return original(*args, **kwargs)

    return wrapper


def _checked_batch(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list, *args, **kwargs):
        for op in p2p_op_list:
            check("batch_isend_irecv", op.group, (op.tensor,))
        return original(p2p_op_list, *args, **kwargs)

    return wrapper


def _recording(original, returns_pair: bool):
    """Wrap a group factory so the groups it makes remember the backend they were asked for."""
    index = _param_index(original, "backend")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if "backend" in kwargs:
            backend = kwargs["backend"]
        else:
            backend = args[index] if index is not None and len(args) > index else None
        result = original(*args, **kwargs)
        groups = [result[0], *result[1]] if returns_pair else [result]
        for group in groups:
            _record(group, backend)
        return result

    return wrapper


def _replacements() -> list:
    """(module, name, wrapper) for every function :func:`install` replaces."""
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for name in COLLECTIVES:
        if hasattr(dist, name):
            out[name] = _checked(name, getattr(dist, name))
    out["batch_isend_irecv"] = _checked_batch(dist.batch_isend_irecv)
    out["new_group"] = _recording(dist.new_group, returns_pair=False)
    for name in ("new_subgroups", "new_subgroups_by_enumeration"):
        if hasattr(dist, name):
            out[name] = _recording(getattr(dist, name), returns_pair=True)
    replaced = [(dist, name, fn) for name, fn in out.items()]
    # P2POp checks ``op in [isend, irecv]`` and batch_isend_irecv ``op.op is isend`` against the
    # c10d module's own names: they must be the same wrappers callers pass in.
    replaced += [(c10d, name, out[name]) for name in ("isend", "irecv")]
    return replaced


def _patch_distributed() -> None:
    for module, name, wrapper in _replacements():
        setattr(module, name, wrapper)


def install() -> bool:
    """Enter :class:`HostTrackingMode` in this thread and wrap the collectives, once per process.
    Does nothing (returns False) on a machine with CUDA. Applies the CPU shims of
    :mod:`launcher.engines.compat` first, so that its mode is below this one: this mode then sees
    ``device="cuda"`` and ``Tensor.cuda()`` before they are mapped to the host."""
    if _STATE["mode"] is not None:
        return True
    if torch.cuda.is_available():
        return False
    from launcher.engines import compat

    compat.install()
    mode = HostTrackingMode()
    mode.__enter__()
    _STATE["mode"] = mode
    _patch_distributed()
    return True


def is_installed() -> bool:
    """Whether strict device mode is installed in this process."""
    return _STATE["mode"] is not None


def enabled_by_env() -> bool:
    """Whether ``TRAINWRIGHT_STRICT_DEVICES=1`` asks for strict device mode."""
    return os.environ.get(ENV_VAR) == "1"


def install_if_requested() -> bool:
    """:func:`install` when ``TRAINWRIGHT_STRICT_DEVICES=1``; whether strict mode is on."""
    return install() if enabled_by_env() else False
