"""The Megatron-LM settings catalogue (``tests/fixtures/catalogue/megatron_lm.json``): how ``jaxpar
port megatron`` classes each option of Megatron-LM's parser at a pinned commit.

Each option is ported on its own, added to a small GPT recipe (:data:`BASE`) with a sample value,
and classed from its report row: ``mapped``, ``approximated``, ``no-effect`` (an approximated row
whose note starts "no-op"), ``refused`` (unsupported, a model change, or a one-line error), or
``unclassified`` (reported as "unknown", which for a real option is a gap of the importer).
``experiments/megatron_catalogue.py`` writes the file; ``tests/test_megatron_catalogue.py`` checks
that every option still gets its class.
"""

from __future__ import annotations

from jaxpar.config import ConfigError
from jaxpar.port.megatron import port_megatron

BASE = (
    "--nproc_per_node 8",
    "--num-layers 4",
    "--hidden-size 256",
    "--num-attention-heads 4",
    "--seq-length 512",
    "--micro-batch-size 1",
    "--global-batch-size 8",
    "--lr 1e-4",
    "--train-iters 10",
    "--vocab-size 1000",
    "--tokenizer-type NullTokenizer",
    "--disable-bias-linear",
)


def probe(option: str, value: str) -> tuple[str, str]:
    """(class, the report's note or the error) of ``option value`` added to :data:`BASE`."""
    text = "# flags\n" + "\n".join([*BASE, f"{option} {value}".strip()]) + "\n"
    try:
        _, report = port_megatron(text, approximate=True, allow_unresolved=True)
    except ConfigError as e:
        return "refused", str(e)
    entry = report.find(option) or report.find(f"{option} (default)")
    if entry is None:
        return "unclassified", "no report row"
    if entry.model or entry.status == "unsupported":
        return "refused", entry.note
    if entry.status == "unknown":
        return "unclassified", entry.note
    if entry.status == "approximated" and entry.note.startswith("no-op"):
        return "no-effect", entry.note
    return entry.status, entry.note
