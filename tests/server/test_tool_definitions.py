"""The tools of a request: each name maps to one parameters schema; the same function listed twice is harmless."""
from __future__ import annotations

import pytest

from strata.errors import RequestError
from strata.server.tools import check_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name, parameters=None, **extra):
    function = {"name": name, **({} if parameters is None else {"parameters": parameters}), **extra}
    return {"type": "function", "function": function}


def test_the_same_function_listed_twice_is_one_tool():
    tools = [tool("get_weather", WEATHER), tool("get_weather", WEATHER, description="again"), tool("now"),
             tool("now", {})]
    assert check_tools(tools) == {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}


def test_one_name_with_two_parameter_schemas_is_refused_naming_the_second():
    with pytest.raises(RequestError, match=r"tools\[1\]: the function name 'get_weather' is given twice with "
                                           "different parameters") as e:
        check_tools([tool("get_weather", WEATHER), tool("get_weather", {"type": "object", "properties": {}})])
    assert e.value.param == "tools"
