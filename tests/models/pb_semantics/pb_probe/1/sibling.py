"""A module beside model.py, imported relatively: Triton imports the model as '1.model'."""
SIBLING = "from the version folder"
