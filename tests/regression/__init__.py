"""Engine regression test support: the case grid/runner and the golden-data recorder."""
