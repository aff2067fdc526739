"""The local web planner (`tunecast serve`): a JSON API and the page that talks to it.

The API answers with the documents the CLI's `--json` prints, made by the same library functions (plan/, estimate/,
data/, config/): `service.py` holds that work apart from HTTP, `jobs.py` runs it in worker threads (progress relayed,
cancelled when the client leaves), `app.py` is the FastAPI application and the page's files. Nothing here is imported
by a command other than `tunecast serve`.
"""
