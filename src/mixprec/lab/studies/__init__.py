"""The numerical studies: ``mixprec study NAME`` (reduction-error, compression-error, matmul-error, comm-cost,
block-scaling), the collective audit (``mixprec audit collectives``) and the demo's measured sections at
simulated data-parallel sizes (scale_study, uint8_study).

Each study is a plain module: a frozen config dataclass that checks itself, a function that measures, and
functions that format its table and write its CSV and plot through :mod:`mixprec.lab.studies.base`. Arguments are
parsed by :mod:`mixprec.cli.study` only; a study module never imports argparse. Modules are imported by name
(``mixprec.lab.studies.reduction_error``): this package imports none of them, so that one study does not pay
for another's imports.
"""
