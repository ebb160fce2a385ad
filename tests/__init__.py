"""The test suite, one module per subject; test_stratagem.py beside stratagem.py holds the tests of the
algorithm itself, and tests/common.py the helpers every module shares."""
