"""Tools for trying asynctaskd out and for testing it, never loaded by the daemon or the
clients (tests/test_api.py checks that):

  fakevendor  a fake vendor: submit once, poll many, with injectable faults
  fakehttp    the small keep-alive HTTP/1.1 server it answers on
  demo        a handler for the fake vendor, the shape of a hand-written integration
  dev         `asynctaskd dev`: embedded Valkey + fake vendor + a daemon + demo tasks
"""
