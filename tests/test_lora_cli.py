"""`tokenmill serve`'s LoRA flags: vLLM's spellings, both forms of --lora-modules, the runtime-updating switch, the
flags that need --enable-lora, and adapters that cannot be served refused at start-up in one sentence."""

from __future__ import annotations

import json

import pytest

from tests.helpers.lora_folders import write_lora_adapter
from tokenmill.cli import build_parser, config_from_args, main
from tokenmill.config import LoRAConfig, LoRAModule
from tokenmill.frontend.lora_registry import check_lora_modules
from tokenmill.lora_cli import RUNTIME_UPDATING_ENV, lora_flags_error


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_lora_modules_take_several_per_flag_repeat_and_accept_json():
    spec = json.dumps({"name": "c", "path": "/r", "base_model_name": "base"})
    args = parse("--enable-lora", "--lora-modules", "a=/p", "b=/q", "--lora-modules", spec, "--max-loras", "3")
    lora = config_from_args(args).lora
    assert lora.lora_modules == [
        LoRAModule(name="a", path="/p"),
        LoRAModule(name="b", path="/q"),
        LoRAModule(name="c", path="/r", base_model_name="base"),
    ]
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 3, 16, None)
    assert lora_flags_error(args) is None


@pytest.mark.parametrize("bad", ["a", "=/p", "a=", '{"name": "a"}', "{not json"])
def test_a_malformed_lora_module_is_an_argument_error(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--enable-lora", "--lora-modules", bad)
    assert "not a LoRA module" in capsys.readouterr().err


def test_runtime_updating_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)
    assert not config_from_args(parse("--enable-lora")).lora.allow_runtime_lora_updating
    flag = parse("--enable-lora", "--allow-runtime-lora-updating")
    assert config_from_args(flag).lora.allow_runtime_lora_updating
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    assert config_from_args(parse("--enable-lora")).lora.allow_runtime_lora_updating
    assert not config_from_args(parse()).lora.allow_runtime_lora_updating  # the environment alone enables no LoRA


@pytest.mark.parametrize(
    "argv",
    [
        ["--lora-modules", "a=/p"],
        ["--max-loras", "2"],
        ["--max-lora-rank", "64"],
        ["--max-cpu-loras", "4"],
        ["--allow-runtime-lora-updating"],
        ["--lora-dtype", "bfloat16"],
    ],
)
def test_lora_flags_without_enable_lora_are_one_sentence_errors(argv, capsys):
    assert lora_flags_error(parse(*argv)) == f"{argv[0]} needs --enable-lora"
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2 and f"{argv[0]} needs --enable-lora" in capsys.readouterr().err


def test_lora_dtype_is_auto_unless_given_and_takes_vllms_choices(capsys):
    assert config_from_args(parse("--enable-lora")).lora.lora_dtype == "auto"
    assert config_from_args(parse("--enable-lora", "--lora-dtype", "bfloat16")).lora.lora_dtype == "bfloat16"
    assert config_from_args(parse("--enable-lora", "--lora-dtype", "float16")).lora.lora_dtype == "float16"
    with pytest.raises(SystemExit):
        parse("--enable-lora", "--lora-dtype", "float8")
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_inconsistent_lora_flags_are_refused():
    error = lora_flags_error(parse("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"))
    assert error == "--max-cpu-loras (2) must be at least --max-loras (4)"
    error = lora_flags_error(parse("--enable-lora", "--lora-modules", "a=/p", "a=/q"))
    assert error == "--lora-modules names an adapter more than once: a"


def test_start_up_refuses_an_adapter_it_cannot_serve(tmp_path):
    ok = str(write_lora_adapter(tmp_path / "ok", rank=16))
    big = str(write_lora_adapter(tmp_path / "big", rank=32))

    def check(*modules: LoRAModule) -> str | None:
        return check_lora_modules(LoRAConfig(enable_lora=True, lora_modules=list(modules)), "served")

    assert check(LoRAModule(name="ok", path=ok)) is None
    assert check(LoRAModule(name="big", path=big)) == (
        "--lora-modules big: The adapter's rank r=32 is above the server's --max-lora-rank 16."
    )
    missing = check(LoRAModule(name="gone", path=str(tmp_path / "gone")))
    assert missing is not None and missing.startswith("--lora-modules gone: No adapter found for")
    assert check(LoRAModule(name="served", path=ok)) == (
        "--lora-modules: the adapter name 'served' is the served model's own name."
    )


def test_serve_exits_with_the_sentence_before_starting_anything(tmp_path, capsys):
    big = str(write_lora_adapter(tmp_path / "big", rank=64))
    assert main(["serve", "--enable-lora", "--lora-modules", f"big={big}"]) == 1
    assert "r=64 is above the server's --max-lora-rank 16" in capsys.readouterr().err
