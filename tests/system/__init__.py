"""Whole process trees and artefacts: make run, the fault and cluster suites, packaging, images, deploy, release."""
