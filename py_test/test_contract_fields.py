"""Every field of the contract reaches the engine (or is refused): nothing is silently ignored.

These tests set each proto field, one at a time, to a non-default value and check
that the conversion's result changes or that the request is refused with a status.
A new field that nobody maps makes them fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from typing import Any

import pytest
from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from vllm_router.contracts.vllm_engine_v1 import convert
from vllm_router.contracts.vllm_grpc_engine import convert as official_convert
from vllm_router.contracts.vllm_native import convert as native_convert
from vllm_router.core import sampling
from vllm_router.engine import GenerationRequest, ModelFacts, SamplingOptions, StructuredOutputs
from vllm_router.errors import ServicerError
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_native_pb2 as npb

from harness import require

FACTS = ModelFacts("m", "m", 100, 50, 2, 16, (2,), "mock", "0")
# Non-default values for message-typed fields (scalars are derived from their type).
MESSAGE_VALUES = {
    "sampling_params": pb.SamplingParams(max_tokens=3),
    "structured_outputs": pb.StructuredOutputs(regex="[a-z]+"),
}
SCALAR_VALUES = {
    FieldDescriptor.CPPTYPE_FLOAT: 0.5,
    FieldDescriptor.CPPTYPE_DOUBLE: 0.5,
    FieldDescriptor.CPPTYPE_INT32: 1,
    FieldDescriptor.CPPTYPE_INT64: 1,
    FieldDescriptor.CPPTYPE_UINT32: 1,
    FieldDescriptor.CPPTYPE_UINT64: 1,
    FieldDescriptor.CPPTYPE_BOOL: True,
    FieldDescriptor.CPPTYPE_STRING: "x",
}


def _set_non_default(message: object, field: FieldDescriptor) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        target[1] = SCALAR_VALUES[field.message_type.fields_by_name["value"].cpp_type]
    elif field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        if field.is_repeated:
            target.add()
        else:
            assert field.name in MESSAGE_VALUES, f"add a non-default value for {field.name}"
            target.CopyFrom(MESSAGE_VALUES[field.name])
    elif field.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
        value = field.enum_type.values[1].number
        if field.is_repeated:
            target.append(value)
        else:
            setattr(message, field.name, value)
    elif field.is_repeated:
        target.append(SCALAR_VALUES[field.cpp_type])
    else:
        setattr(message, field.name, SCALAR_VALUES[field.cpp_type])


@pytest.mark.parametrize("field", list(pb.SamplingParams.DESCRIPTOR.fields), ids=lambda f: f.name)
def test_every_sampling_field_reaches_sampling_options(field: FieldDescriptor) -> None:
    params = pb.SamplingParams()
    _set_non_default(params, field)
    options = convert.to_sampling_options(params)
    assert options != SamplingOptions(), f"sampling_params.{field.name} is ignored"


def _convert_or_refuse(request: pb.GenerateRequest) -> GenerationRequest | str:
    try:
        return convert.to_generation_request(request, FACTS)
    except ServicerError as exc:
        return exc.code.name


@pytest.mark.parametrize("field", list(pb.GenerateRequest.DESCRIPTOR.fields), ids=lambda f: f.name)
def test_every_generate_request_field_is_used_or_refused(field: FieldDescriptor) -> None:
    # Two baselines: a token prompt and a text prompt (prompt_text counts only without ids).
    baselines = [
        pb.GenerateRequest(request_id="r", prompt_token_ids=[1]),
        pb.GenerateRequest(request_id="r", prompt_text="y"),
    ]
    for baseline in baselines:
        changed = pb.GenerateRequest()
        changed.CopyFrom(baseline)
        _set_non_default(changed, field)
        before, after = _convert_or_refuse(baseline), _convert_or_refuse(changed)
        assert isinstance(before, GenerationRequest)
        if after != before:
            return
    pytest.fail(f"GenerateRequest.{field.name} changes nothing and is not refused")


def test_every_contract_reads_sampling_through_the_one_table() -> None:
    """Every sampling field of each contract's proto is read by its contract's SamplingTable
    (driven by the one SamplingOptions declaration) or named as read elsewhere: a new proto
    field fails here until it is mapped."""
    assert convert.SAMPLING.covered == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    official = official_convert.SAMPLING.covered | official_convert.HANDLED_ELSEWHERE
    assert official == set(vpb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert not official_convert.SAMPLING.covered & official_convert.HANDLED_ELSEWHERE
    # vLLM's native request spreads its sampling over four parts (and `temperature`).
    parts = ("sampling", "decoding", "stopping", "response")
    native = {
        f"{part}.{name}"
        for part in parts
        for name in npb.GenerateRequest.DESCRIPTOR.fields_by_name[part].message_type.fields_by_name
    }
    read = native_convert.SAMPLING.covered | native_convert.HANDLED_ELSEWHERE
    assert read == native | {"temperature"}
    assert not native_convert.SAMPLING.covered & native_convert.HANDLED_ELSEWHERE


def test_native_sampling_as_vllm_rs_reads_it() -> None:
    """Every field the native table reads, set, and the zeros vllm-rs reads as unset."""
    request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=[1]),
        temperature=0.5,
        sampling=npb.RandomSampling(num_sequences=2, top_k=5, top_p=0.5, min_p=0.25, seed=7),
        decoding=npb.DecodingParameters(
            presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5,
            logit_bias={3: 0.5}, allowed_token_ids=[3, 4], regex="[a-z]",
        ),
        stopping=npb.StoppingCriteria(
            max_new_tokens=9, min_new_tokens=2, stop_token_ids=[5], stop_strings=["x"],
            include_stop_strings=True, ignore_eos=True,
        ),
        response=npb.ResponseOptions(
            skip_special_tokens=False, output_logprobs=True, prompt_logprobs=True,
            output_candidates=npb.CandidateTokens(token_ids=npb.TokenIds(ids=[6])),
            prompt_candidates=npb.CandidateTokens(all=True),
        ),
    )  # fmt: skip
    assert native_convert.SAMPLING.read(request) == SamplingOptions(
        temperature=0.5, n=2, top_k=5, top_p=0.5, min_p=0.25, seed=7,
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5,
        logit_bias={3: 0.5}, allowed_token_ids=(3, 4),
        structured_outputs=StructuredOutputs(regex="[a-z]"),
        max_tokens=9, min_tokens=2, stop_token_ids=(5,), stop=("x",),
        include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False,
        logprobs=None, logprob_token_ids=(6,), prompt_logprobs=-1,
    )  # fmt: skip
    unset = native_convert.SAMPLING.read(npb.GenerateRequest())
    assert unset == SamplingOptions(
        temperature=0.0, n=1, min_tokens=0, include_stop_str_in_output=False, ignore_eos=False
    )


# Each contract's table, and the message its conversion hands it.
TABLES = {
    "vllm.engine.v1": (convert.SAMPLING, pb.SamplingParams),
    "vllm.grpc.engine": (official_convert.SAMPLING, vpb.SamplingParams),
    "vllm native": (native_convert.SAMPLING, npb.GenerateRequest),
}
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.CPPTYPE_FLOAT: st.sampled_from([0.0, -0.0, 0.25, 1.0, 2.5]),
    FieldDescriptor.CPPTYPE_DOUBLE: st.sampled_from([0.0, -0.0, 0.25, 1.0, 2.5]),
    FieldDescriptor.CPPTYPE_INT32: st.integers(-2, 5),
    FieldDescriptor.CPPTYPE_INT64: st.sampled_from([-1, 0, 3, 2**40]),
    FieldDescriptor.CPPTYPE_UINT32: st.sampled_from([0, 1, 7, 2**32 - 1]),
    FieldDescriptor.CPPTYPE_UINT64: st.sampled_from([0, 1, 2**40]),
    FieldDescriptor.CPPTYPE_BOOL: st.booleans(),
    FieldDescriptor.CPPTYPE_STRING: st.text(max_size=3),
}


def _read_field_by_field(table: sampling.SamplingTable, params: Message) -> SamplingOptions:
    """The table's rule as core/sampling.py states it, one field at a time (getattr and
    HasField for every field), which `read` must match while it converts only set ones."""
    values: dict[str, Any] = {}
    for name, part, proto_name, kind in table._fields:
        message = getattr(params, part) if part else params
        value: Any = getattr(message, proto_name)
        if kind == sampling._REPEATED:
            value = tuple(value)
        elif kind == sampling._MAP:
            value = dict(value) or None
        elif kind == sampling._PRESENCE and not message.HasField(proto_name):
            value = None
        if name in table._fallbacks and (value is None or (kind == sampling._PLAIN and not value)):
            value = table._fallbacks[name]
        values[name] = value
    for name, special in table._special.items():
        values[name] = special(params)
    return SamplingOptions(**values)


@settings(max_examples=300, deadline=None)
@given(contract=st.sampled_from(sorted(TABLES)), data=st.data())
def test_sampling_read_of_set_fields_matches_the_field_by_field_rule(
    contract: str, data: st.DataObject
) -> None:
    """Any subset of a contract's sampling fields set, to zeros (-0.0 too), ordinary or
    extreme values: the table's read, which converts only the fields a message sets, gives
    what reading every field by the rule gives (fallbacks for unset and zero fields, None
    for unset fields with presence, tuples, maps or None)."""
    table, message_class = TABLES[contract]
    params = message_class()
    for _, part, proto_name, _ in table._fields:
        message = getattr(params, part) if part else params
        field = message.DESCRIPTOR.fields_by_name[proto_name]
        if not data.draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            entries = st.dictionaries(_SCALARS[key.cpp_type], _SCALARS[value.cpp_type], max_size=3)
            getattr(message, proto_name).update(data.draw(entries))
        elif field.is_repeated:
            getattr(message, proto_name).extend(
                data.draw(st.lists(_SCALARS[field.cpp_type], max_size=3))
            )
        else:
            setattr(message, proto_name, data.draw(_SCALARS[field.cpp_type]))
    try:
        expected: Any = _read_field_by_field(table, params)
    except ServicerError as exc:  # a special converter refuses: read must refuse the same
        with pytest.raises(type(exc)) as refused:
            table.read(params)
        assert str(refused.value) == str(exc)
        return
    assert table.read(params) == expected


def test_the_vllm_adapter_passes_every_sampling_field_to_vllm() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    from vllm.sampling_params import SamplingParams

    from vllm_router.engine.vllm import params as vllm_params

    accepted = set(inspect.signature(SamplingParams.from_optional).parameters)
    read = set(vllm_params._MODEL_DEFAULTED) | set(vllm_params._PASSED_THROUGH)
    read |= vllm_params._BUILT
    assert read == {f.name for f in dataclasses.fields(SamplingOptions)}
    assert read <= accepted, read - accepted


# -- vLLM's official contract (vllm.grpc.engine) ---------------------------------------------------

# Handled by the servicer, not by the request conversion (with the reason).
OFFICIAL_SERVICER_FIELDS = {"stream": "chunks and a complete per sample, or one complete"}
OFFICIAL_VALUES = {
    "sampling_params": vpb.SamplingParams(max_tokens=3),
    "tokenized": vpb.TokenizedInput(input_ids=[4, 5]),
    "choice": vpb.ChoiceConstraint(choices=["a"]),
    "kv_transfer_params": vpb.KvTransferParams(remote_host="h", remote_port=1),
}


def _set_official(message: object, field: FieldDescriptor) -> None:
    # 2, not 1: an `n` of 1 (or a top_k of 1...) is a value the conversion may also default to.
    if field.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_UINT32):
        if field.is_repeated:
            getattr(message, field.name).append(2)
        else:
            setattr(message, field.name, 2)
    elif field.name in OFFICIAL_VALUES:
        getattr(message, field.name).CopyFrom(OFFICIAL_VALUES[field.name])
    elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
        target = getattr(message, field.name)
        (target.add() if field.is_repeated else target).SetInParent()
    else:
        _set_non_default(message, field)


def _official(request: vpb.GenerateRequest) -> GenerationRequest | str:
    try:
        return official_convert.to_generation_request(request, FACTS, None)
    except ServicerError as exc:
        return exc.code.name


@pytest.mark.parametrize("field", list(vpb.SamplingParams.DESCRIPTOR.fields), ids=lambda f: f.name)
def test_every_official_sampling_field_is_used_or_refused(field: FieldDescriptor) -> None:
    base = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    changed = vpb.GenerateRequest()
    changed.CopyFrom(base)
    _set_official(changed.sampling_params, field)
    assert _official(changed) != _official(base), f"sampling_params.{field.name} is ignored"


def test_the_servicer_handled_fields_are_real_fields() -> None:
    assert set(OFFICIAL_SERVICER_FIELDS) <= set(vpb.GenerateRequest.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize(
    "field",
    [f for f in vpb.GenerateRequest.DESCRIPTOR.fields if f.name not in OFFICIAL_SERVICER_FIELDS],
    ids=lambda f: f.name,
)
def test_every_official_request_field_is_used_or_refused(field: FieldDescriptor) -> None:
    base = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    changed = vpb.GenerateRequest()
    changed.CopyFrom(base)
    _set_official(changed, field)
    assert _official(changed) != _official(base), f"GenerateRequest.{field.name} is ignored"


# -- vLLM's native contract (vllm.Inference) ----------------------------------------------------

# Read by the servicer (what goes back to the client), not by the request conversion.
NATIVE_SERVICER_FIELDS = {
    "response.output_token_ids": "token ids in each SequenceOutput",
    "response.prompt_token_ids": "the prompt's ids in PromptInfo",
}
NATIVE_VALUES: dict[str, object] = {
    "token_ids": npb.TokenIds(ids=[4, 5]),
    "choice": npb.StringChoices(choices=["a"]),
    "prompt_candidates": npb.CandidateTokens(top_n=2),
    "output_candidates": npb.CandidateTokens(top_n=2),
    "kv_transfer_params": struct_pb2.Struct(fields={"k": struct_pb2.Value(string_value="v")}),
    "ec_transfer_params": struct_pb2.Struct(fields={"k": struct_pb2.Value(string_value="v")}),
    "media": npb.MediaItem(url="data:,x"),
    "kv_hints": npb.KvHints(message_id="m"),
    "engine_reasoning_gate": npb.ReasoningGate(reasoning_ended=True),
    "bad_words_token_ids": npb.TokenIds(ids=[3]),
}
# Sub-messages whose fields are checked one by one.
NATIVE_PARTS = ("sampling", "decoding", "stopping", "response", "kv")


def _native_fields() -> list[tuple[str, FieldDescriptor]]:
    fields = [("", f) for f in npb.GenerateRequest.DESCRIPTOR.fields if f.name not in NATIVE_PARTS]
    for part in NATIVE_PARTS:
        message = npb.GenerateRequest.DESCRIPTOR.fields_by_name[part].message_type
        fields += [(part, f) for f in message.fields]
    return [(p, f) for p, f in fields if f"{p}.{f.name}" not in NATIVE_SERVICER_FIELDS]


def _set_native(message: Any, field: FieldDescriptor) -> None:
    target = getattr(message, field.name)
    if field.name in NATIVE_VALUES:
        value = NATIVE_VALUES[field.name]
        (target.add() if field.is_repeated else target).CopyFrom(value)
    elif field.message_type is not None and field.message_type.GetOptions().map_entry:
        target[7] = 0.5
    elif field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        if field.is_repeated:
            target.append("x")
        else:
            setattr(message, field.name, "x")
    else:
        _set_official(message, field)


def _native(request: npb.GenerateRequest) -> GenerationRequest | str:
    try:
        return native_convert.to_generation_request(request, FACTS, None, None)
    except ServicerError as exc:
        return exc.code.name


@pytest.mark.parametrize(
    ("part", "field"), _native_fields(), ids=lambda v: v if isinstance(v, str) else v.name
)
def test_every_native_request_field_is_used_or_refused(part: str, field: FieldDescriptor) -> None:
    base = npb.GenerateRequest(token_ids=npb.TokenIds(ids=[1, 2, 3]))
    # Candidates and prompt scores count only with their logprobs switch, as vllm-rs reads them.
    if part == "response" and field.name in ("output_candidates", "prompt_candidates"):
        base.response.output_logprobs = base.response.prompt_logprobs = True
    changed = npb.GenerateRequest()
    changed.CopyFrom(base)
    _set_native(getattr(changed, part) if part else changed, field)
    name = f"{part}.{field.name}" if part else field.name
    assert _native(changed) != _native(base), f"GenerateRequest.{name} is ignored"


def test_the_native_servicer_fields_are_real_fields() -> None:
    for name in NATIVE_SERVICER_FIELDS:
        part, field = name.split(".")
        message = npb.GenerateRequest.DESCRIPTOR.fields_by_name[part].message_type
        assert field in message.fields_by_name, name


def test_a_sampling_table_refuses_names_it_cannot_place() -> None:
    """A contract's renames and fallbacks must name fields that exist: a typo fails at
    import, not as a silently unread field."""
    from vllm_router.core.sampling import SamplingTable

    with pytest.raises(ValueError, match="no part has"):
        SamplingTable(npb.GenerateRequest.DESCRIPTOR, parts=("sampling",), names={"n": "nope"})
    with pytest.raises(ValueError, match="SamplingOptions lacks"):
        SamplingTable(npb.GenerateRequest.DESCRIPTOR, fallbacks={"not_a_field": 1})
