"""Helpers shared by the test modules, imported as ``support.<module>`` (``tests/`` is on ``sys.path``:
``pythonpath`` in ``[tool.pytest.ini_options]``; scripts the tests start as subprocesses get it through
``PYTHONPATH``, see :func:`support.paths.subprocess_env`).

Fixtures stay in ``conftest.py`` files; test modules never import one another.
"""
