"""Package layout that pyproject.toml cannot state: the bundled small models (models/small)
install as the data package `powerfusion.demo_models`, so the README's demo runs from a wheel.
Everything else about the package is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["powerfusion", "powerfusion.*"], exclude=["*__pycache__*"]) + ["powerfusion.demo_models"],
      package_dir={"powerfusion.demo_models": "models/small"},
      package_data={"powerfusion.demo_models": ["*.onnx", "manifest.json"]})
