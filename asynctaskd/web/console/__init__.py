"""The operator console: a browser UI served by `asynctaskd web` at `/` (docs/console.md).

`session` (login sessions kept in Redis, their CSRF token), `audit` (the stream of who
did what), `views` (the reads the pages need that the API has no route for: overview,
browse, find, a task with its timeline), `routes` (login, logout, those reads, the static
files). Actions go through the `/api/v1` routes themselves, with the session cookie and
its CSRF header in place of a bearer token. Nothing here is imported below `web`.
"""
