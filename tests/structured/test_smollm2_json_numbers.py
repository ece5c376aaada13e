"""The real SmolLM2-135M-Instruct GGUF, asked for JSON with an integer and a number field: without a bound on
digits it writes `122.2483838383...` until max_tokens; with it, every answer ends on its own and validates."""
from __future__ import annotations

import json

import jsonschema
import pytest
from smollm2 import smollm2_gguf

from strata import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer"}, "area_km2": {"type": "number"}},
          "required": ["city", "population", "area_km2"], "additionalProperties": False}
QUESTIONS = ["Give the population and area of Paris as JSON.", "Tell me about Tokyo in JSON.",
             "What is the population of Berlin?"]


@pytest.mark.slow
def test_chat_json_with_integer_and_number_fields_ends_and_validates():
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with LLM(str(smollm2_gguf()), max_model_len=512) as llm:
        outputs = llm.chat(conversations, params, use_tqdm=False)
    for question, out in zip(QUESTIONS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (question, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMA)
