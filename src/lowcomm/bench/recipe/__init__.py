"""Bench recipes: `lowcomm bench RECIPE.toml`. read.py reads and checks a recipe, keys.py sets
its keys on a run's config, grid.py plans one run per variant, swept value and seed, bench.py
runs them and writes the report (bench/report/recipe.py)."""
from .read import Recipe, Variant, load_recipe

__all__ = ["Recipe", "Variant", "load_recipe"]
