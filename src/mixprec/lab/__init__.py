"""The numerics lab: training runs, comparisons and studies."""
