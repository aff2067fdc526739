"""Reading sizes at marker dimensions as polynomials (symbols.py): no torch."""

from __future__ import annotations

import itertools

import pytest

from tunecast.estimate import symbols

M = symbols.MARKERS


def value_of(poly: symbols.Poly, **values: int) -> int:
    return symbols.evaluate(poly, values)


@pytest.mark.parametrize("exponents, constant", [
    ({"b": 1, "s": 1, "V": 1}, 4),                      # fp32 logits
    ({"hd2": 1, "kv": 1, "x": 1, "g": 1}, 4),           # a bf16 key projection weight, 2·hd2 × hidden
    ({"b": 1, "kv": 1, "g": 1, "s": 2}, 2),             # eager attention scores in bf16
    ({"r": 1, "i": 1}, 4),                              # an fp32 LoRA matrix
    ({}, 8),                                            # a scalar
    ({"b": 1, "s": 1, "kv": 1, "g": 1, "hd2": 2}, 5),   # attention's backward FLOPs
])
def test_a_product_of_dimensions_is_read_back(exponents: dict[str, int], constant: int) -> None:
    n = constant
    for name, power in exponents.items():
        n *= M[name] ** power
    poly = symbols.factor(n, M)
    assert poly == symbols.one(exponents, constant)
    check = symbols.CHECK_MARKERS
    expected = constant
    for name, power in exponents.items():
        expected *= check[name] ** power
    assert symbols.evaluate(poly, check) == expected


def test_a_dimension_off_by_one_is_read_as_a_sum() -> None:
    """The loss's labels padded by one position: 8·b·(s + 1) bytes."""
    poly = symbols.factor(8 * M["b"] * (M["s"] + 1), M)
    assert poly is not None
    assert value_of(poly, b=4, s=71) == 8 * 4 * 72
    assert value_of(poly, b=2, s=1000) == 8 * 2 * 1001


def test_no_reading_for_a_number_that_is_no_product_of_the_markers() -> None:
    assert symbols.factor(M["s"] * 29 * 31, M) is None
    assert symbols.factor(M["b"] * M["s"] + M["V"], M) is None


@pytest.mark.parametrize("markers", [symbols.MARKERS, symbols.MOE_MARKERS])
def test_neighbours_of_the_markers_are_told_apart(markers: dict[str, int]) -> None:
    """What makes `s + 1` readable: the micro-batch's and the length's neighbours each have a prime factor
    above 5 that no marker and no other neighbour has."""
    def rough(n: int) -> set[int]:
        found, d = set(), 2
        while d * d <= n:
            while n % d == 0:
                found.add(d)
                n //= d
            d += 1
        if n > 1:
            found.add(n)
        return {p for p in found if p > 5}

    seen = set(markers.values())
    assert min(seen) > 5 and len(seen) == len(markers) == len(symbols.VARIABLES)
    for prime, offset in itertools.product((markers["b"], markers["s"]), (1, -1)):
        factors = rough(prime + offset)
        assert factors and not factors & seen, (prime, offset)
        seen |= factors


def test_polynomials_add_and_multiply() -> None:
    s_plus_one = symbols.add((symbols.one({"s": 1}), symbols.one({})))
    square = symbols.multiply(s_plus_one, s_plus_one)
    assert value_of(square, s=9) == 100
    assert symbols.from_json(symbols.to_json(square)) == square
    assert symbols.add((square, symbols.multiply(square, symbols.one({}, -1)))) == ()


def test_dimensions_of_a_dense_config() -> None:
    llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "vocab_size": 128256}
    assert symbols.dense_dimensions(llama) == {"kv": 8, "g": 4, "hd2": 64, "x": 128, "i": 14336, "V": 128256}
    values = symbols.variable_values(llama, rank=16, batch=None)
    assert values is not None and values["x"] == 1 and values["r"] == 16  # head size derived: x folded into hd2
    shaped = symbols.marker_config(llama, M)
    assert shaped["hidden_size"] == M["kv"] * M["g"] * 2 * M["hd2"] and "head_dim" not in shaped
    mha = {**llama, "num_key_value_heads": 32}
    assert symbols.marker_config(mha, M)["num_attention_heads"] == M["kv"]  # one query head per kv head stays so
    assert symbols.structure(mha) != symbols.structure(llama)
    assert symbols.dense_dimensions({"model_type": "gpt2", "n_embd": 768}) is None
    assert symbols.dense_dimensions({**llama, "num_key_value_heads": 5}) is None  # 32 heads in 5 groups


def test_structure_ignores_token_ids_and_constants() -> None:
    base = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936, "rope_theta": 1e6, "bos_token_id": 1,
            "tie_word_embeddings": True}
    other = {**base, "hidden_size": 1536, "num_attention_heads": 12, "rope_theta": 1e4, "bos_token_id": 7,
             "vocab_size": 32000}
    assert symbols.structure(base) == symbols.structure(other)
    assert symbols.structure({**base, "tie_word_embeddings": False}) != symbols.structure(base)


@pytest.mark.parametrize("check", [symbols.CHECK_MARKERS, symbols.MOE_CHECK_MARKERS])
def test_the_check_markers_give_every_variable_its_own_value(check: dict[str, int]) -> None:
    assert len(set(check.values())) == len(check) == len(symbols.VARIABLES)


def test_moe_marker_models_keep_16_byte_strides_and_real_head_sizes() -> None:
    """Grouped expert matmuls need every width to be a multiple of 8 elements; attention kernels choose by
    head size, so the marker heads stay among real ones (64-256)."""
    config = {"model_type": "qwen3_moe", "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048,
              "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
              "num_experts_per_tok": 8, "vocab_size": 151936}
    for check in (False, True):
        shaped = symbols.marker_config(config, symbols.markers(config, check=check))
        for key in ("hidden_size", "head_dim", "intermediate_size", "moe_intermediate_size"):
            assert shaped[key] % 8 == 0, (key, shaped[key])
        assert 64 <= shaped["head_dim"] <= 256
    values = symbols.variable_values(config, 16, None)
    assert values is not None and (values["hd2"], values["x"], values["m"], values["e"], values["k"]) == (16, 8, 96,
                                                                                                          128, 8)
    assert symbols.variable_values({**config, "moe_intermediate_size": 770}, 16, None) is None  # not in units of 8


def test_the_config_defaults_table_is_what_transformers_fills_in() -> None:
    """data/config_defaults.json holds, for each type a template reads, the entries its config class fills in (not
    the sizes, nor what it derives from them): as the installed transformers builds each class."""
    import importlib.util
    import json
    from pathlib import Path

    from tunecast.catalog.models import class_defaults_table_path

    script = Path(__file__).resolve().parents[3] / "scripts" / "update_config_defaults.py"
    loaded = importlib.util.spec_from_file_location("update_config_defaults", script)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    shipped = json.loads(class_defaults_table_path().read_text())
    built = json.loads(json.dumps(module.table(), default=str))
    assert shipped == built, "run .venv/bin/python scripts/update_config_defaults.py"
    assert set(shipped["model_types"]) == symbols.DENSE_TYPES | set(symbols.MOE_TYPES)
    llama = shipped["model_types"]["llama"]
    assert llama["tie_word_embeddings"] is False and "head_dim" not in llama and "hidden_size" not in llama
