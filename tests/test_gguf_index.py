"""tokenmill/gguf_index.py against gguf's own GGUFReader: the same metadata (arrays by their length) and the same
tensors, bit for bit, on the shipped model's file and on a file holding every value type; and a clear error for a file
that is not whole GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tokenmill.gguf_index import GGUFArray, read_gguf


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = read_gguf(path), GGUFReader(path)
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}  # its header
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        value = ours.fields[key]
        if isinstance(value, GGUFArray):  # GGUFReader's data of a nested array indexes its innermost elements
            assert value.element_type == field.types[1]
            assert value.count == len(field.data) or field.types[1] == GGUFValueType.ARRAY
        else:
            assert value == pytest.approx(field.contents()) if isinstance(value, float) else value == field.contents()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type and mine.shape == tuple(int(n) for n in reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data, equal_nan=True) and not mine.data.flags.writeable


def test_the_shipped_models_file_reads_as_gguf_reads_it():
    path = str(smollm2_dir() / SMOLLM2_GGUF)
    assert_same_as_gguf_reader(path)
    fields = read_gguf(path, with_tensors=False).fields
    assert fields["general.architecture"] == "llama" and fields["llama.embedding_length"] == 576
    assert fields["tokenizer.ggml.tokens"] == GGUFArray(int(GGUFValueType.STRING), 49152)


def every_value_type(path: str, alignment: int) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.15625)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo, wörld")
    writer.add_array("t.strings", ["a", "", "ccc" * 50])
    writer.add_array("t.ints", [1, 2, 3, 4])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = quantize(weights, GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_alignment_reads_as_gguf_reads_it(tmp_path, alignment):
    path = str(tmp_path / "every.gguf")
    every_value_type(path, alignment)
    assert_same_as_gguf_reader(path)
    fields = read_gguf(path).fields
    assert fields["t.u64"] == 2**63 + 5 and fields["t.str"] == "héllo, wörld" and fields["t.bool"] is True
    assert fields["t.nested"] == GGUFArray(int(GGUFValueType.ARRAY), 2)


def test_a_file_that_is_not_whole_gguf_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "every.gguf"
    every_value_type(str(path), 32)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for length, message in [(len(whole) - 64, "tensor q8 runs past its end"), (40, "not a whole GGUF file")]:
        cut.write_bytes(whole[:length])
        with pytest.raises(ValueError, match=message):
            read_gguf(str(cut))
    cut.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(str(cut))
