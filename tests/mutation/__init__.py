"""The mutation catalog: one-line breaks of the rules that matter, each one a named test kills.

`catalog.MUTANTS` lists them; `python -m tests.mutation` (`make mutants`) applies each to a
copy of the repository and runs the tests it names there, which must fail. A mutant whose
tests still pass survived: a rule the suite does not guard, and the run fails.
`tests/test_mutation_catalog.py` keeps the catalog applicable as the code moves (every
mutant's text occurs exactly once, every test it names exists) without running it.
"""
