"""The shipped Qwen3-235B-A22B recipe compiles for v5p-256 (see `test_moe_recipes_aot.py`; a
module of its own so that it runs beside the 30B-A3B compile)."""

from test_moe_recipes_aot import check_shipped_recipe, pytestmark  # noqa: F401


def test_shipped_235b_recipe_compiles_and_fits():
    check_shipped_recipe("235B-A22B v5p-256")
