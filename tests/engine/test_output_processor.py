"""Output processing on its own (no core, no model): the core's token ids become text; a stop string ends a sample
there, once, and nothing the core made after it reaches the output; the core's finishes and stop strings in the same
token in their order of precedence; the output token ids kept once. Texts are checked against transformers' decode."""
from __future__ import annotations

import pytest
from checkpoints import write_tokenizer
from transformers import AutoTokenizer

from strata.engine.input_processor import fan_out
from strata.engine.output_processor import OutputProcessor
from strata.engine.request import CoreOutput, CoreRequest, ProcessedPrompt, RequestStatus
from strata.sampling_params import SamplingParams

PROMPT = "A prompt:"
TEXT = " the quick brown fox jumps over the lazy dog, and that is the end of it all"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def processor_with(tokenizer, request_id: str = "r", **params) -> tuple[OutputProcessor, list[int]]:
    processor = OutputProcessor(tokenizer)
    sampling = SamplingParams(**params)
    prompt = ProcessedPrompt(PROMPT, tokenizer(PROMPT).input_ids)
    processor.add_request(CoreRequest(request_id, prompt, sampling, fan_out(request_id, sampling), 0.0))
    return processor, tokenizer(TEXT, add_special_tokens=False).input_ids


def end_index(tokenizer, ids: list[int], stop: str) -> int:
    """The index of the token whose text completes the first `stop`."""
    return next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[:i + 1]))


def test_a_stop_string_ends_the_sample_without_waiting_for_min_tokens_and_asks_the_core_to_finish_it(tokenizer):
    processor, ids = processor_with(tokenizer, stop=["end"], min_tokens=100, max_tokens=200)
    k = end_index(tokenizer, ids, "end")
    for token in ids[:k]:
        processed = processor.process_outputs([CoreOutput("r", [token])])
        assert processed.finished_ids == [] and not processed.request_outputs[0].finished
    processed = processor.process_outputs([CoreOutput("r", [ids[k]])])
    assert processed.finished_ids == ["r"]
    (out,) = processed.request_outputs
    sample = out.outputs[0]
    assert out.finished and (sample.finish_reason, sample.stop_reason) == ("stop", "end")
    decoded = tokenizer.decode(ids[:k + 1])
    assert sample.token_ids == ids[:k + 1] and sample.text == decoded[:decoded.find("end")]
    assert not processor.has_unfinished()


def test_tokens_the_core_made_after_a_stop_string_never_reach_the_output(tokenizer):
    processor, ids = processor_with(tokenizer, n=2, stop=["end"], logprobs=0)
    k = end_index(tokenizer, ids, "end")
    # Sample 0 gets every token in one output (accepted drafts after the stop string too); sample 1 runs on.
    processed = processor.process_outputs([CoreOutput("r#0", ids), CoreOutput("r#1", ids[:3])])
    assert processed.finished_ids == ["r#0"]
    (out,) = processed.request_outputs
    first, second = out.outputs
    assert first.token_ids == ids[:k + 1] and first.finish_reason == "stop" and not out.finished
    # Until the core hears of the finish, it may make more tokens for sample 0: they are dropped.
    later = processor.process_outputs([CoreOutput("r#0", [ids[0]]), CoreOutput("r#1", [ids[3]], finish_status=
                                                                               RequestStatus.FINISHED_LENGTH)])
    assert later.finished_ids == []
    (out,) = later.request_outputs
    first, second = out.outputs
    assert out.finished and first.token_ids == ids[:k + 1] and second.token_ids == ids[:4]
    decoded = tokenizer.decode(ids[:k + 1])
    assert first.text == decoded[:decoded.find("end")] and second.text == tokenizer.decode(ids[:4])
    assert processor.num_generation_tokens == len(first.token_ids) + len(second.token_ids)
    assert processor.process_outputs([CoreOutput("r#0", [ids[1]])]).request_outputs == []


def test_length_wins_over_a_stop_string_in_the_same_token(tokenizer):
    processor, ids = processor_with(tokenizer, stop=["end"])
    k = end_index(tokenizer, ids, "end")
    processed = processor.process_outputs([CoreOutput("r", ids[:k + 1], finish_status=RequestStatus.FINISHED_LENGTH)])
    sample = processed.request_outputs[0].outputs[0]
    assert (sample.finish_reason, sample.stop_reason) == ("length", None) and processed.finished_ids == []


def test_a_stop_token_wins_over_a_stop_string_in_the_same_token(tokenizer):
    processor, ids = processor_with(tokenizer, stop=["end"], include_stop_str_in_output=True)
    k = end_index(tokenizer, ids, "end")
    processed = processor.process_outputs([CoreOutput("r", ids[:k + 1], finish_status=RequestStatus.FINISHED_STOPPED,
                                                      stop_reason=ids[k], stopped_on_token=True)])
    sample = processed.request_outputs[0].outputs[0]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", ids[k]) and processed.finished_ids == []
    assert sample.text == tokenizer.decode(ids[:k + 1])  # the stop token's text kept, as asked


def test_the_text_of_the_stop_token_that_ended_a_sample_is_left_out(tokenizer):
    processor, ids = processor_with(tokenizer)
    processed = processor.process_outputs([CoreOutput("r", ids[:6], finish_status=RequestStatus.FINISHED_STOPPED,
                                                      stop_reason=ids[5], stopped_on_token=True)])
    sample = processed.request_outputs[0].outputs[0]
    assert sample.token_ids == ids[:6] and sample.text == tokenizer.decode(ids[:5])


def test_a_stop_string_wins_over_a_finished_grammar_in_the_same_token(tokenizer):
    processor, ids = processor_with(tokenizer, stop=["end"])
    k = end_index(tokenizer, ids, "end")
    processed = processor.process_outputs([CoreOutput("r", ids[:k + 1], finish_status=RequestStatus.FINISHED_STOPPED)])
    sample = processed.request_outputs[0].outputs[0]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "end")
    assert processed.finished_ids == []  # the core ended it already


def test_output_token_ids_are_stored_once(tokenizer):
    processor, ids = processor_with(tokenizer)
    ids = (ids * 4)[:60]
    seq = processor.groups["r"].sequences[0]
    for token in ids[:-1]:
        processor.process_outputs([CoreOutput("r", [token])])
    (out,) = processor.process_outputs([CoreOutput("r", ids[-1:], finish_status=RequestStatus.FINISHED_LENGTH)]
                                       ).request_outputs
    # The RequestOutput's ids are a copy of the one list; the detokenizer keeps only the window it decodes again.
    assert out.outputs[0].token_ids == seq.token_ids == ids and out.outputs[0].token_ids is not seq.token_ids
    assert len(seq.detokenizer.ids) <= 2
    assert out.outputs[0].text == tokenizer.decode(ids)


def test_a_duplicate_request_id_is_refused(tokenizer):
    from strata.errors import RequestError

    processor, _ = processor_with(tokenizer)
    sampling = SamplingParams()
    with pytest.raises(RequestError):
        processor.add_request(CoreRequest("r", ProcessedPrompt(None, [5]), sampling, fan_out("r", sampling), 0.0))
