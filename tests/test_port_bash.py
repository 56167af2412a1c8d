"""The bash reader of Megatron launch scripts (jaxpar.port.bash), one construct per test, each a small
script read as bash runs it: strings and arrays over lines, comments, here-documents, ``+=``, loops,
``case``, ``eval`` / ``sh -c``, command substitutions in the command path. What cannot be decided
statically is refused with one line naming it (exit 2), never guessed. Conditions: test_port_shell_if.py."""

from __future__ import annotations

import contextlib
import io
import time

import pytest

from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.port.bash import Shell, launch_flags, script_lines, unresolved_names
from jaxpar.port.megatron import port_megatron
from tests.helpers import ROOT

BLOOM = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "megatron_deepspeed" / "bloom_tr11_176B_ml.slurm"
# a complete small GPT recipe: with --nproc_per_node 8 it ports with exit 0
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 3e-4 --vocab-size 1000 --tokenizer-type "
    "NullTokenizer --disable-bias-linear --bf16 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights"
)


def _flags(script: str, **variables: str) -> list[tuple[str, list[str]]]:
    flags, stray, _ = launch_flags(script, Shell(variables))
    assert stray == []
    return flags


def _port(script: str, tmp_path, *args: str) -> tuple[int, str]:
    path = tmp_path / "run.sh"
    path.write_text(script)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["port", "megatron", str(path), "-o", str(tmp_path / "out.py"), *args])
    return code, err.getvalue()


def test_inline_comment_inside_an_array_does_not_end_it():
    script = "ARGS=(\n  --a 1  # the first (one)\n  --b  # on\n  --c 3\n)\npython pretrain_gpt.py ${ARGS[@]}\n"
    assert _flags(script) == [("--a", ["1"]), ("--b", []), ("--c", ["3"])]


def test_comment_lines_ending_in_a_backslash_continue_nothing():
    script = "# launch it \\\npython pretrain_gpt.py \\\n  --a 1 \\\n  --b 2\n# --c 3 \\\n"
    assert _flags(script) == [("--a", ["1"]), ("--b", ["2"])]


def test_multi_line_double_quoted_string_with_continuations():
    script = 'GPT_ARGS="\n    --num-layers 24 \\\n    --fp16\n"\ntorchrun pretrain_gpt.py $GPT_ARGS --lr 1\n'
    assert _flags(script) == [("--num-layers", ["24"]), ("--fp16", []), ("--lr", ["1"])]


def test_string_appended_to_itself_over_lines():
    script = (
        'opts=" \\\n    --a 1"\nif [ "$X" = yes ]; then\nopts="${opts} \\\n    --b"\nfi\n'
        "deepspeed pretrain_gpt.py ${opts}\n"
    )
    assert _flags(script, X="yes") == [("--a", ["1"]), ("--b", [])]
    assert _flags(script, X="no") == [("--a", ["1"])]


def test_array_appended_over_lines():
    script = 'A=(--a 1)\nA+=(\n  "--b 2"\n  --c\n)\nA+=("--d")\npython pretrain_gpt.py ${A[@]}\n'
    assert _flags(script) == [("--a", ["1"]), ("--b", ["2"]), ("--c", []), ("--d", [])]


def test_string_with_an_unknown_word_keeps_its_known_flags():
    script = 'OUT="--save /ckpt/$(date +%s) --lr 2"\npython pretrain_gpt.py $OUT\n'
    flags = dict(_flags(script))
    assert flags["--lr"] == ["2"]
    assert [unresolved_names(v) for v in flags["--save"]] == [["$(date...)"]]  # one word, marked unknown


def test_argument_loop_not_run_without_arguments(tmp_path):
    script = (
        "TOK=MOCK\nwhile [[ $# -gt 0 ]]; do\n  case $1 in\n    --tokenizer) TOK=$2; shift 2 ;;\n"
        "    *) exit 1 ;;\n  esac\ndone\npython pretrain_gpt.py --tok $TOK\n"
    )
    assert _flags(script) == [("--tok", ["MOCK"])]
    with pytest.raises(ConfigError, match=r"line 2: the loop `while \[\[ \$# -gt 0 \]\]` runs"):
        port_megatron(
            script + f"torchrun --nproc_per_node 8 pretrain_gpt.py {MODEL} --tok $TOK\n", variables={"1": "x"}
        )


def test_for_loop_assignments_are_unknown():
    script = "N=1\nfor i in 1 2 3; do\n  N=$((N*2))\ndone\npython pretrain_gpt.py --n $N\n"
    with pytest.raises(ConfigError, match=r"line 2: the loop `for i in 1 2 3` runs, and jaxpar does not run loops"):
        launch_flags(script, Shell())
    assert _flags("for i in 1 2; do\n  echo $i\ndone\npython pretrain_gpt.py --n 1\n") == [("--n", ["1"])]


@pytest.mark.parametrize(("size", "layers"), [("7B", "32"), ("13B", "40"), ("70b", "80")])
def test_case_takes_the_first_matching_clause(size, layers):
    script = (
        'case "$SIZE" in\n  7B) L=32 ;;\n  13B|13b)\n    L=40\n    ;;\n  *) L=80 ;;\nesac\n'
        "python pretrain_gpt.py --num-layers $L\n"
    )
    assert _flags(script, SIZE=size) == [("--num-layers", [layers])]


def test_case_with_its_first_clause_on_its_line():
    script = "case $S in 7B) L=32 ;; *) L=80 ;; esac\npython pretrain_gpt.py --num-layers $L\n"
    assert _flags(script, S="7B") == [("--num-layers", ["32"])]
    assert _flags(script, S="1B") == [("--num-layers", ["80"])]


def test_unset_variable_is_empty():
    script = 'A=1\nB=2\nunset A\nif [ -z "$A" ]; then B=3; fi\npython pretrain_gpt.py --b $B --a ${A:-9}\n'
    assert _flags(script) == [("--b", ["3"]), ("--a", ["9"])]


def test_case_of_an_unknown_word_is_refused_naming_it():
    script = "case $SIZE in\n  7B) L=32 ;;\n  *) L=80 ;;\nesac\npython pretrain_gpt.py --num-layers $L\n"
    with pytest.raises(ConfigError, match=r"line 1: the condition `case \$SIZE in` reads \$SIZE.*--var SIZE=VALUE"):
        launch_flags(script, Shell())


@pytest.mark.parametrize(
    "run",
    [
        'eval "$run_cmd"',
        "eval ${run_cmd}",
        'sh -c "$run_cmd"',
        'srun --jobid 7 bash -x -c "cd /x; $run_cmd" 2>&1 | tee log',
    ],
)
def test_command_built_in_a_string_and_run_by_eval_or_a_shell(run):
    script = f'opts="--a 1 --split \'9,1\'"\nrun_cmd="deepspeed pretrain_gpt.py ${{opts}} &> log.txt"\n{run}\n'
    assert _flags(script) == [("--a", ["1"]), ("--split", ["9,1"])]  # quotes and redirection read by the shell


@pytest.mark.parametrize("path", ["`pwd`/pretrain_gpt.py", "$(pwd)/pretrain_gpt.py", "$HOSTNAME/pretrain_gpt.py"])
def test_command_path_from_a_command_substitution(path):
    assert _flags(f'CMD="{path} --a 1"\necho $CMD\npython -u $CMD > out.log\n') == [("--a", ["1"])]


@pytest.mark.parametrize(
    "line",
    [
        "cd /src && torchrun pretrain_gpt.py --a 1 --tok '<pad>' 2>&1 | tee log",
        "mkdir -p x; python pretrain_gpt.py --a 1 --tok '<pad>' > out.log 2> err.log &",
        "python pretrain_gpt.py --a 1 --tok '<pad>' &>> log || exit 1",
    ],
)
def test_lists_pipes_and_redirections_around_the_command(line):
    assert _flags(line + "\n") == [("--a", ["1"]), ("--tok", ["<pad>"])]


def test_functions_run_where_they_are_called_with_their_arguments():
    script = (
        "TP=1\nset_tp() {\n  TP=$1\n}\nfunction launch\n{\n  torchrun pretrain_gpt.py --tp $TP --pp $PP\n}\n"
        "PP=2\nset_tp 4\none() { PP=$1; }\none 3\nlaunch\n"
    )
    assert _flags(script) == [("--tp", ["4"]), ("--pp", ["3"])]
    assert _flags("f() {\n  python pretrain_gpt.py --a 9\n}\npython pretrain_gpt.py --a 1\n") == [("--a", ["1"])]


def test_unclosed_function_and_endless_recursion_are_one_line():
    with pytest.raises(ConfigError, match=r"^megatron: the function f's body is never closed"):
        launch_flags("f() {\n  A=1\npython pretrain_gpt.py --a 1\n", Shell())
    with pytest.raises(ConfigError, match=r"^megatron: line 1: over 1000 function calls or 10012 lines"):
        launch_flags("f() { f; }\nf\npython pretrain_gpt.py --a 1\n", Shell())


def test_echo_of_the_command_is_not_the_command():
    script = 'echo "python pretrain_gpt.py --a 1"\ntorchrun --nproc_per_node 2 pretrain_gpt.py --a 2\n'
    assert _flags(script) == [("--nproc_per_node", ["2"]), ("--a", ["2"])]


def test_here_document_bodies_are_input_not_commands():
    script = 'cat <<EOT > ds.json\n{ "it\'s": 1 }\npython pretrain_gpt.py --a 9\nEOT\npython pretrain_gpt.py --a 1\n'
    assert _flags(script) == [("--a", ["1"])]
    assert [n for n, _ in script_lines(script)] == [1, 5]


def test_arithmetic_shift_is_not_a_here_document():
    script = "N=1\nif (( N << 2 == 4 )); then\n  L=4\nfi\npython pretrain_gpt.py --num-layers $L\n"
    assert _flags(script) == [("--num-layers", ["4"])]


def test_here_document_read_by_sbatch_is_the_script():
    script = 'CMD="python pretrain_gpt.py --a 1"\nsbatch <<EOF\n#!/bin/bash\nsrun bash -c "${CMD}"\nEOF\necho done\n'
    assert _flags(script) == [("--a", ["1"])]


def test_finetune_gpt_is_a_training_entry_point():
    shell = Shell()
    launch_flags("python -m torch.distributed.run examples/detxoify_lm/finetune_gpt.py --a 1\n", shell)
    assert shell.script == "finetune_gpt.py"


def test_placeholder_with_a_suffix_is_unknown_not_a_redirection():
    shell = Shell()
    launch_flags("DATA=<Specify path and file prefix>_text_document\npython pretrain_gpt.py --data-path $DATA\n", shell)
    assert shell.why["DATA"] == "placeholder <Specify path and file prefix>"


def test_script_argument_the_recipe_never_sets_is_exit_2_naming_flag_and_argument(tmp_path):
    code, err = _port(f"L=$1\ntorchrun --nproc_per_node 8 pretrain_gpt.py {MODEL} --num-layers $L\n", tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "L (needs $1; used by --num-layers)" in err and "pass --var NAME=VALUE" in err
    assert (
        _port(
            f"L=$1\ntorchrun --nproc_per_node 8 pretrain_gpt.py {MODEL} --num-layers $L\n",
            tmp_path,
            "--var",
            "1=3",
            "--overwrite",
        )[0]
        == 0
    )


def test_command_substitution_whose_output_matters_is_exit_2(tmp_path):
    code, err = _port(f"G=$(nvidia-smi -L | wc -l)\ntorchrun --nproc_per_node $G pretrain_gpt.py {MODEL}\n", tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "G (needs $(nvidia-smi...)" in err and "--nproc_per_node" in err


def test_quote_never_closed_is_its_line_alone():
    script = "echo it's\npython pretrain_gpt.py --a 1\n"
    flags, _, repaired = launch_flags(script, Shell())
    assert flags == [("--a", ["1"])] and repaired == [(1, "echo it's")]


@pytest.mark.parametrize(
    "text",
    [
        "".join(f'A{i}="--f{i} \\\n {i}\n"\n' for i in range(3000)) + "echo '\n" * 200 + "python pretrain_gpt.py $A7\n",
        "python pretrain_gpt.py --f7 7\n" + "echo $(\n" * 20_000,  # each line opens a $( never closed
        "python pretrain_gpt.py --f7 7\n" + 'x="${\n' * 20_000,
        "A=()\n" + "".join(f"A+=(--f{i} {i})\n" for i in range(20_000)) + "python pretrain_gpt.py --f7 7\n",
    ],
    ids=["strings", "unclosed-command-substitutions", "unclosed-expansions", "array-appends"],
)
def test_hostile_scripts_read_in_linear_time(text):
    """Measured 0.1-0.7 s each on 2 shared cores (a rescan per unclosed line took 190 s, re-reading the
    whole array per append 90 s)."""
    start = time.monotonic()
    flags, _, _ = launch_flags(text, Shell())
    assert flags[:1] == [("--f7", ["7"])]
    assert time.monotonic() - start < 10


def test_many_calls_of_a_long_function_stop_in_linear_time():
    text = "f() {\n" + "A=1\n" * 20_000 + "}\n" + "f\n" * 1000 + "python pretrain_gpt.py --a 1\n"
    start = time.monotonic()
    with pytest.raises(ConfigError, match="line 20007: over 1000 function calls or 94012 lines read through them"):
        launch_flags(text, Shell())
    assert time.monotonic() - start < 10


def test_bloom_176b_split_70_layers_on_12_stages():
    """BLOOM-176B: 70 layers, PP 12, `--pp-partition-method 'type:transformer|embedding'` (the embedding
    counts as a layer on the first and the last stage: 72 / 12 = 6 units, so 5 layers there, 6 on the 10
    others); ALiBi is refused by name, so the split is checked with --approximate."""
    with pytest.raises(ConfigError, match="--position-embedding-type = alibi"):
        port_megatron(BLOOM, variables={"SLURM_NNODES": "24"}, approximate=False)
    cfg, report = port_megatron(BLOOM, variables={"SLURM_NNODES": "24"}, approximate=True)
    assert (cfg.model.num_layers, cfg.mesh.pipeline, cfg.mesh.tensor, cfg.mesh.data) == (70, 12, 4, 4)
    assert (cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers) == (5, 5)
    assert report.find("--pp-partition-method").target == "parallel.first_stage_layers, parallel.last_stage_layers"
