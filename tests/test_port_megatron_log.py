"""Megatron's printed arguments (a training log's ``arguments`` block) as a fourth input form of
``jaxpar port megatron``: the log of a run ports to the config of the script that produced it
(a real pair: tests/fixtures/recipes/corpus/megatron/llm_action_gpt2_345m_mp.{sh,log})."""

from __future__ import annotations

import contextlib
import io

import pytest

from jaxpar.acts import flatten
from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.port.megatron import port_megatron
from tests.port_recipes import FIXTURES

PAIR = FIXTURES / "corpus" / "megatron" / "llm_action_gpt2_345m_mp"
# the script's launch line with its variables substituted by hand (llm_action_gpt2_345m_mp.sh)
SCRIPT_FLAGS = """# flags
--nproc_per_node 4
--nnodes 1
--node_rank 0
--master_addr localhost
--master_port 6069
--tensor-model-parallel-size 2
--pipeline-model-parallel-size 2
--sequence-parallel
--num-layers 24
--hidden-size 1024
--num-attention-heads 16
--seq-length 1024
--max-position-embeddings 1024
--micro-batch-size 4
--global-batch-size 16
--lr 0.00015
--train-iters 5000
--lr-decay-iters 320000
--lr-decay-style cosine
--min-lr 1.0e-5
--weight-decay 1e-2
--lr-warmup-fraction .01
--clip-grad 1.0
--fp16
--data-path /workspace/data/my-gpt2_text_document
--vocab-file /workspace/model/gpt2-vocab/gpt2-vocab.json
--merge-file /workspace/model/gpt2-vocab/gpt2-merges.txt
--data-impl mmap
--split 700,200,100
--log-interval 100
--save-interval 2000
--eval-interval 1000
--eval-iters 10
--distributed-backend nccl
--save /workspace/model/megatron-models/345m-init-mp
--load /workspace/model/megatron-models/345m-init-mp
"""


def _flat(source) -> dict:
    cfg, _ = port_megatron(source, approximate=True)
    return flatten(cfg.to_dict())


def test_log_ports_as_the_flags_of_its_script():
    log = _flat(PAIR.with_suffix(".log"))
    assert log == _flat(SCRIPT_FLAGS)
    assert (log["mesh.tensor"], log["mesh.pipeline"], log["mesh.data"], log["parallel.microbatches"]) == (2, 2, 1, 4)
    assert (log["model.compute_dtype"], log["train.loss_scale.initial_scale_power"]) == ("float16", 32)


def test_log_ports_as_its_script():
    assert _flat(PAIR.with_suffix(".log")) == _flat(PAIR.with_suffix(".sh"))


def _log(*lines: str, after: str = "building GPT model ...") -> str:
    head = "------------------------ arguments ------------------------"
    tail = "-------------------- end of arguments ---------------------"
    return "\n".join(["noise before", head, *lines, tail, after, ""])


BASE = [
    "  num_layers ...................................... 2",
    "  hidden_size ..................................... 64",
    "  num_attention_heads ............................. 4",
    "  seq_length ...................................... 128",
    "  max_position_embeddings ......................... 128",
    "  micro_batch_size ................................ 1",
    "  global_batch_size ............................... 8",
    "  train_iters ..................................... 10",
    "  lr .............................................. 0.0003",
    "  vocab_size ...................................... 1000",
    "  tokenizer_type .................................. NullTokenizer",
    "  add_bias_linear ................................. False",
    "  bf16 ............................................ True",
    "  encoder_num_layers .............................. 2",
    "  data_path ....................................... ['0.3', '/d/a', '0.7', '/d/b']",
    "  swiglu .......................................... True",
    "  hysteresis ...................................... 2",
    "  rank ............................................ 0",
    "  world_size ...................................... 8",
]


def test_each_logged_value_becomes_its_option():
    cfg, report = port_megatron(_log(*BASE))
    # store_false (add_bias_linear False = --disable-bias-linear), store_true, a list, defaults left out
    assert report.find("--disable-bias-linear") is not None and report.find("--bf16").status == "mapped"
    assert report.find("--hysteresis") is None  # 2 is the default: not given
    assert cfg.model.compute_dtype == "bfloat16" and cfg.model.mlp_activation == "swiglu"
    assert (cfg.data.path, report.find("--data-path").note) == ("/d/a", "first of 2 blended prefixes")
    assert (cfg.mesh.data, cfg.train.global_batch) == (8, 8)  # world_size 8 over TP 1
    assert report.find("(log) world_size").status == "mapped"
    assert report.find("(log) encoder_num_layers").note == "Megatron sets it from num_layers"
    assert "no option of NVIDIA/Megatron-LM" in report.find("(log) rank").note
    cfg, _ = port_megatron(_log(*BASE), world_size=4)  # --world-size wins over the log's
    assert cfg.mesh.data == 4


def test_a_prefix_on_every_line_is_dropped():
    """srun --label and torchrun --tee prefix each line with the rank: the header's prefix is every line's."""
    labeled = "\n".join("0: " + line if line else line for line in _log(*BASE).splitlines())
    assert flatten(port_megatron(labeled)[0].to_dict()) == flatten(port_megatron(_log(*BASE))[0].to_dict())


def test_the_log_says_which_model_it_trained():
    with pytest.raises(ConfigError, match=r"pretrain_bert.py trains"):
        port_megatron(_log(*BASE, after="building BERT model ..."), approximate=False)


@pytest.mark.parametrize(
    "text, message",
    [
        (_log(*BASE) + _log(*BASE), r"the log holds 2 'arguments' blocks \(several runs\); keep the lines of one run"),
        (_log(*BASE).split("-------------------- end")[0], r"has no 'end of arguments' line"),
        (_log(*BASE, "  garbage"), r"log line 22 'garbage' is not 'name \.\.\.\. value'"),
    ],
)
def test_a_broken_log_is_refused_in_one_line(text, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        port_megatron(text)
    path = tmp_path / "train.log"
    path.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["port", "megatron", str(path)]) == 2
    assert len(err.getvalue().strip().splitlines()) == 1 and "Traceback" not in err.getvalue()
