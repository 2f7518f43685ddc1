"""A module in the model's folder, beside config.pbtxt: Triton puts that folder on the path."""
FOLDER = "from the model's folder"
