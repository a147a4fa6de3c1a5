pytest_plugins = ["distbench.pytest_plugin"]
