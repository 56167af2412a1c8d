"""Device groups of a collective, read from its ``replica_groups`` / ``source_target_pairs`` text.

XLA prints a collective's groups in these forms (``tests/test_hlo_groups.py`` keeps them verbatim
from compiles of jax 0.10.2 and 0.12, the rest as XLA's printer writes them):

* explicit lists ``{{0,1},{2,3}}``; ``{}`` is one group of every device;
* iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``: ``arange`` over the reshape dims, transposed,
  reshaped to (groups, group size);
* named mesh ``mesh['data'=4,'tensor'=2] {'tensor'}``: a mesh's devices (iota, or ``, device_ids=``
  ``[4,2]T(1,0)`` or a list), grouped over the listed axes in order; a sub-axis ``'x':(2)4`` is
  the size-4 factor of ``x`` split row-major into (2, 4, the rest); ``{}`` groups each device
  alone. jax 0.12 prints shard_map collectives so; XLA's partitioner names its axes ``axis_0``...;
* ``single_device[device_id=3] {}``: one group of one device.

Meshes are expanded to device ids, not read by name (the names need not be the jax mesh's, nor the
order iota); :mod:`jaxpar.analysis.compiled` names axes from the ids. Any other form is a one-line
:class:`ValueError`: counting a collective over every device would misattribute its bytes silently.
"""

from __future__ import annotations

import math
import re

import numpy as np

_LIST = r"\{(?:\{[\d,\s]*\},?\s*)*\}"
_IOTA = r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
_DEVICE_IDS = r"\((?:\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\)"
_MESH = rf"mesh\[[^\]]*\](?:, device_ids={_DEVICE_IDS})? \{{[^}}]*\}}"
_SINGLE = r"single_device\[device_id=\d+\] \{\}"
_END = r"(?=,|\s*$)"  # the value must end where the attribute does
_GROUPS = re.compile(rf"\breplica_groups=({_LIST}|{_IOTA}|{_MESH}|{_SINGLE}){_END}")
_PAIRS = re.compile(rf"\bsource_target_pairs=({_LIST}){_END}")
_MESH_PARTS = re.compile(r"mesh\[([^\]]*)\](?:, device_ids=\((.*)\))? \{([^}]*)\}")  # applied after _MESH
_MESH_AXIS = re.compile(r"'([^']*)'=(\d+)")
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")

Groups = list[list[int]]


def replica_groups(attrs: str) -> Groups | None:
    """The groups of a collective's attribute text (``replica_groups=...``); None: every device.

    Raises ValueError when the attribute is missing or in a form this module does not know."""
    m = _GROUPS.search(attrs)
    if m is None:
        raise ValueError(f"unrecognised replica_groups: {_attribute(attrs, 'replica_groups')}")
    return parse_replica_groups(m.group(1))


def source_target_pairs(attrs: str) -> Groups:
    """The (source, target) device pairs of a collective-permute's attribute text.

    Raises ValueError when the attribute is missing or not an explicit list of pairs."""
    m = _PAIRS.search(attrs)
    pairs = _explicit(m.group(1)) if m else None
    if m is None or any(len(p) != 2 for p in pairs):
        raise ValueError(f"unrecognised source_target_pairs: {_attribute(attrs, 'source_target_pairs')}")
    return pairs


def _attribute(attrs: str, key: str) -> str:
    """``key=value`` as printed (up to the next attribute), for error messages; ``key`` absent: say so."""
    m = re.search(rf"\b{key}=(.*?)(?=, [a-z_]+=|$)", attrs)
    return f"'{key}={m.group(1)}'" if m else f"no {key} in '{attrs.strip()[:120]}'"


def parse_replica_groups(text: str) -> Groups | None:
    """Device-id groups of a replica-group value in any form XLA prints (see the module docstring);
    None for ``{}`` (every device in one group). Raises ValueError on any other form."""
    if re.fullmatch(_LIST, text):
        return _explicit(text) or None
    if re.fullmatch(_IOTA, text):
        return _iota_groups(text)
    if re.fullmatch(_MESH, text):
        return _mesh_groups(text)
    m = re.fullmatch(r"single_device\[device_id=(\d+)\] \{\}", text)
    if m:
        return [[int(m.group(1))]]
    raise ValueError(f"unrecognised replica_groups '{text}'")


def _explicit(text: str) -> Groups:
    """``{{0,1},{2,3}}`` -> [[0, 1], [2, 3]]."""
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """``arange`` over ``reshape``, transposed by ``perm``, flat: XLA's iota tile assignment."""
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _iota_groups(text: str) -> Groups:
    """``[groups,size]<=[reshape]T(perm)`` -> the groups of the transposed iota."""
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    shape, reshape = _ints(m.group(1)), _ints(m.group(2))
    if math.prod(shape) != math.prod(reshape) or len(shape) != 2:
        raise ValueError(f"unrecognised replica_groups '{text}': {shape} is not groups x size of {reshape}")
    return _iota(reshape, _ints(m.group(3)) if m.group(3) else None).reshape(shape).tolist()


def _mesh_groups(text: str) -> Groups:
    """``mesh[axes](, device_ids=(...))? {refs}`` -> groups: the mesh's devices with each referenced
    (sub-)axis split out and moved last, in the order of the refs, one group per remaining index."""
    axes_text, ids_text, refs_text = _MESH_PARTS.fullmatch(text).groups()
    axes = _mesh_axes(axes_text, text)
    sizes = [size for _, size in axes]
    ids = _mesh_device_ids(ids_text, math.prod(sizes), text)
    refs = _axis_refs(refs_text, [name for name, _ in axes], text)
    dims, grouped = _split_dims(sizes, refs, text)
    rest = [i for i in range(len(dims)) if i not in grouped]
    group_size = math.prod(dims[i] for i in grouped)
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, group_size).tolist()


def _mesh_axes(axes_text: str, text: str) -> list[tuple[str, int]]:
    """``'data'=4,'tensor'=2`` -> [("data", 4), ("tensor", 2)]."""
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(axes_text)]
    if not axes or ",".join(f"'{n}'={s}" for n, s in axes) != axes_text:
        raise ValueError(f"unrecognised replica_groups '{text}': mesh axes '{axes_text}'")
    return axes


def _mesh_device_ids(ids_text: str | None, count: int, text: str) -> np.ndarray:
    """The mesh's device ids in row-major mesh order: iota, ``[4,2]T(1,0)`` or an explicit list."""
    if ids_text is None:
        return np.arange(count)
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
    ids = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None) if m else np.array(_ints(ids_text))
    if ids.size != count or sorted(ids.tolist()) != list(range(count)):
        raise ValueError(f"unrecognised replica_groups '{text}': device_ids are not a permutation of {count} ids")
    return ids


def _axis_refs(refs_text: str, names: list[str], text: str) -> list[tuple[int, int | None, int | None]]:
    """``'tensor','data':(2)2`` -> [(axis index, pre-size or None, size or None)], in the printed order."""
    refs = []
    for part in refs_text.split(",") if refs_text else []:
        m = _AXIS_REF.fullmatch(part)
        if m is None or m.group(1) not in names:
            raise ValueError(f"unrecognised replica_groups '{text}': axis '{part}'")
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (None, None)
        refs.append((names.index(m.group(1)), pre, size))
    return refs


def _split_dims(
    sizes: list[int], refs: list[tuple[int, int | None, int | None]], text: str
) -> tuple[list[int], list[int]]:
    """The mesh dims with every sub-axis split out (minor factors last, as in a row-major reshape),
    and the position of each ref among them, in the refs' order."""
    dims: list[int] = []
    slot: dict[int, int] = {}
    for axis, full in enumerate(sizes):
        mine = sorted((k for k, r in enumerate(refs) if r[0] == axis), key=lambda k: refs[k][1] or 0)
        done = 1  # product of this axis's factors laid out so far
        for k in mine:
            _, pre, size = refs[k]
            pre, size = (1, full) if pre is None else (pre, size)
            if pre < done or pre % done or size < 1 or full % (pre * size) or (len(mine) > 1 and size == full):
                raise ValueError(f"unrecognised replica_groups '{text}': sub-axes that do not tile axis {axis}")
            if pre > done:
                dims.append(pre // done)
            slot[k] = len(dims)
            dims.append(size)
            done = pre * size
        if done < full:
            dims.append(full // done)
    return dims, [slot[k] for k in range(len(refs))]
