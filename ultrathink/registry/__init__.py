"""MLflow tracking and model registry: one run per trained model, champion/challenger aliases.

Import the submodules directly (`ultrathink.registry.tracking`, `ultrathink.registry.promote`): promotion pulls in
transformers for the Hugging Face export, which stages that only track runs should not pay for at start-up.
pyfunc_model.py is never imported here: MLflow executes it by path when logging and loading.
"""
