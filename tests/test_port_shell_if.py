"""``if``/``elif``/``else``/``fi`` in launch scripts (jaxpar.port.bash.launch_flags): only the taken branch
runs; a condition that cannot be known refuses the port with one line naming it, never both branches."""

from __future__ import annotations

import pytest

from jaxpar.errors import ConfigError
from jaxpar.port.bash import Shell, launch_flags
from jaxpar.port.megatron import port_megatron
from tests.helpers import ROOT

MOE64 = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "megatron_deepspeed" / "moe_gpt_125M_MoE64.sh"
CMD = "torchrun pretrain_gpt.py --x $X $OPTS\n"


def _run(script: str, **variables: str) -> tuple[str, list[str]]:
    shell = Shell(variables)
    flags, _, _ = launch_flags(script + CMD, shell)
    values = dict(flags)
    return values["--x"][0], [n for n, _ in flags if n != "--x"]


# (condition, variables, taken?)
CONDITIONS = [
    ('[ "$A" = yes ]', {"A": "yes"}, True),
    ('[ "$A" = yes ]', {"A": "no"}, False),
    ('[ "$A" == yes ]', {"A": "yes"}, True),
    ('[ "$A" != yes ]', {"A": "yes"}, False),
    ("[[ $A == y* ]]", {"A": "yes"}, True),
    ('[[ "$A" != "yes" ]]', {"A": "no"}, True),
    ('test "$A" = yes', {"A": "no"}, False),
    ('[ -z "$A" ]', {"A": ""}, True),
    ('[ -z "$A" ]', {"A": "x"}, False),
    ('[ -n "$A" ]', {"A": "x"}, True),
    ("[[ -n $A ]]", {"A": ""}, False),
    ("[ $N -eq 2 ]", {"N": "2"}, True),
    ("[ $N -ne 2 ]", {"N": "2"}, False),
    ("[ $N -lt 2 ]", {"N": "1"}, True),
    ("[ $N -le 2 ]", {"N": "3"}, False),
    ("[[ $N -gt 2 ]]", {"N": "3"}, True),
    ("[[ $N -ge 4 ]]", {"N": "3"}, False),
    ('[ ! "$A" = yes ]', {"A": "yes"}, False),
    ('! [ "$A" = yes ]', {"A": "no"}, True),
    ('[ "$A" = yes ] && [ $N -eq 1 ]', {"A": "yes", "N": "1"}, True),
    ('[ "$A" = yes ] && [ $N -eq 1 ]', {"A": "yes", "N": "2"}, False),
    ('[ "$A" = yes ] || [ $N -eq 1 ]', {"A": "no", "N": "1"}, True),
    ('[[ "$A" = yes && $N -eq 1 ]]', {"A": "yes", "N": "2"}, False),
    ('[[ "$A" = no || $N -eq 1 ]]', {"A": "yes", "N": "1"}, True),
    ('[ "$A" = no -o $N -eq 1 ]', {"A": "no", "N": "5"}, True),
    ('[ "$A" = no ] || [ "$B" = x ]', {"A": "no"}, True),  # B unknown but not needed
    ('[ "$A" = no ] && [ "$B" = x ]', {"A": "yes"}, False),
    ("true", {}, True),
    ("false", {}, False),
    ("(( N > 1 ))", {"N": "2"}, True),
    ("(( N * 2 == 4 && $M ))", {"N": "2", "M": "0"}, False),
    ("(( N ))", {"N": "0"}, False),
]


@pytest.mark.parametrize("condition,variables,taken", CONDITIONS)
def test_each_condition_form_selects_its_branch(condition, variables, taken):
    script = f'X=base\nOPTS=""\nif {condition}; then\n  X=then\n  OPTS="$OPTS --then-flag"\nelse\n  X=else\nfi\n'
    x, flags = _run(script, **variables)
    assert x == ("then" if taken else "else")
    assert flags == (["--then-flag"] if taken else [])


@pytest.mark.parametrize(
    "mode,expected",
    [("a", "1"), ("b", "2"), ("c", "3"), ("d", "other")],
)
def test_elif_chain_takes_the_first_true_branch(mode, expected):
    script = (
        'if [ "$M" = a ]; then X=1\n'
        'elif [ "$M" = b ]\nthen\n  X=2\n'
        'elif [[ $M = c ]]; then X=3; elif [ "$M" = a ]; then X=wrong\n'
        "else X=other; fi\n"
    )
    assert _run(script, M=mode)[0] == expected


@pytest.mark.parametrize(
    "a,b,expected,flags",
    [("1", "1", "ab", ["--a", "--b"]), ("1", "0", "a", ["--a"]), ("0", "1", "none", []), ("0", "0", "none", [])],
)
def test_nested_ifs(a, b, expected, flags):
    script = (
        "OPTS=()\n"
        'if [ "$A" = 1 ]; then\n'
        "  OPTS+=(--a)\n"
        '  if [ "$B" = 1 ]; then X=ab; OPTS+=(--b); else X=a; fi\n'
        "else\n"
        '  if [ "$B" = 1 ]; then UNUSED=1; fi\n'
        "  X=none\n"
        "fi\n"
    )
    x, got = _run(script.replace("$OPTS", "${OPTS[@]}"), A=a, B=b)
    assert (x, got) == (expected, flags)


def test_one_line_if_and_the_recipe_bugs():
    # the forms met in public recipes: a flag false, PROFILE=0
    script = (
        "USE_REMAT=false\nPROFILE=0\nX=none\nOPTS=\n"
        'if [ "$USE_REMAT" = true ]; then X=full; fi\n'
        'if [ $PROFILE -eq 1 ]; then OPTS="$OPTS --profile"; fi\n'
    )
    assert _run(script) == ("none", [])


@pytest.mark.parametrize(
    "condition,needs",
    [
        ('[ "$USE_FLASH" = true ]', "$USE_FLASH"),
        ("[[ $N -gt 1 ]]", "$N"),
        ("(( N > 1 ))", "$N"),
        ('[ "$(hostname)" = x ]', "$$(hostname...)"),
    ],
)
def test_unknown_condition_refuses_with_line_and_variable(condition, needs):
    script = f"X=base\n\nif {condition}; then\n  X=on\nelse\n  X=off\nfi\n"
    with pytest.raises(ConfigError) as e:
        launch_flags(script + CMD, Shell())
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"megatron: line 3: the condition `{condition}` reads {needs}, which is unknown")
    assert "it decides $X" in msg


def test_unknown_condition_names_the_variable_to_pass_and_passing_it_works():
    script = 'OPTS=""\nif [ "$USE_FLASH" = true ]; then\n  OPTS="$OPTS --use-flash-attn"\nfi\nX=1\n'
    with pytest.raises(ConfigError, match=r"line 2: .*reads \$USE_FLASH.*pass --var USE_FLASH=VALUE"):
        launch_flags(script + CMD, Shell())
    assert _run(script, USE_FLASH="true")[1] == ["--use-flash-attn"]


def test_unknown_condition_that_the_command_does_not_read_is_harmless():
    script = 'X=1\nif [ "$UNKNOWN" = 1 ]; then LOGDIR=/a; else LOGDIR=/b; fi\n'
    assert _run(script) == ("1", [])


def test_unknown_condition_around_the_command_is_refused():
    script = 'X=1\nif [ "$MODE" = a ]; then\n  torchrun pretrain_gpt.py --x 2\nfi\n'
    with pytest.raises(ConfigError, match=r"line 2: .*\$MODE.*pretrain command on line 3 runs only in one"):
        launch_flags(script, Shell())


def test_allow_unresolved_skips_both_branches_never_applies_both():
    shell = Shell()
    shell.allow_unresolved = True
    script = 'X=base\nOPTS=""\nif [ "$U" = 1 ]; then X=a; OPTS="--a"; else X=b; OPTS="--b"; fi\n'
    flags, _, _ = launch_flags(script + CMD, shell)
    assert flags == [("--x", ["base"])]
    assert shell.skipped and "line 3" in shell.skipped[0]


@pytest.mark.parametrize(
    "guard",
    [
        'if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then echo "missing"; exit 1; fi',
        'if [ ! -d "$DATA" ]; then\n  echo "no data $DATA"\n  exit 1\nfi',
        "if [ -e /some/file ]; then echo found; exit 0; fi",
    ],
)
def test_guard_lines_do_not_stop_a_port(guard):
    script = f"PRETRAIN_SCRIPT_PATH=/m/pretrain_gpt.py\nX=1\n{guard}\n"
    assert _run(script) == ("1", [])


def test_file_test_is_known_for_a_directory_the_script_made():
    script = "mkdir -p /out/logs\nX=none\nif [ -d /out/logs ]; then X=made; fi\n"
    assert _run(script)[0] == "made"
    with pytest.raises(ConfigError, match=r"tests the file system \(-f /out/x\)"):
        launch_flags("X=none\nif [ -f /out/x ]; then X=made; fi\n" + CMD, Shell())


def test_exit_in_a_taken_branch_refuses():
    with pytest.raises(ConfigError, match=r"line 1: the script exits here"):
        launch_flags('if [ -z "$1" ]; then echo usage; exit 1; fi\n' + CMD, Shell({"1": ""}))


@pytest.mark.parametrize("drop,has_flag", [("true", False), ("false", True)])
def test_moe64_token_dropping_flag_only_when_its_branch_is_taken(drop, has_flag):
    variables = {"DIR": "/w", "NUM_GPUS": "64", "current_time": "t", "HOSTNAME": "h", "MOE_DROP_TOKEN": drop}
    flags, _, _ = launch_flags(MOE64.read_text(), Shell(variables))
    names = [n for n, _ in flags]
    assert ("--disable-moe-token-dropping" in names) == has_flag
    assert dict(flags)["--moe-expert-parallel-size"] == ["64"]  # EP_SIZE 64 is not > NUM_GPUS 64: the else branch
    assert "--checkpoint-activations" in names and "--create-moe-param-group" in names
    # the script's own default (MOE_DROP_TOKEN="true") through the port: its refusal no longer cites the flag
    if drop == "true":
        with pytest.raises(ConfigError) as e:
            port_megatron(MOE64, variables={k: v for k, v in variables.items() if k != "MOE_DROP_TOKEN"}, world_size=64)
        assert "(on unless --disable-moe-token-dropping)" in str(e.value)  # refused for the default, not the flag


def test_moe64_without_the_gpu_count_names_its_condition():
    with pytest.raises(ConfigError) as e:
        launch_flags(MOE64.read_text(), Shell({"DIR": "/w", "current_time": "t", "HOSTNAME": "h"}))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("megatron: line 131: the condition `[[ $EP_SIZE -gt $NUM_GPUS ]]` reads $NUM_GPUS")
    assert "pass --var NUM_GPUS=VALUE" in msg
