"""Test support: helpers and harnesses the tests, the benchmarks and the dev scripts share."""
