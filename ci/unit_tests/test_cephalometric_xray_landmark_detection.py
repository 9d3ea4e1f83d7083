# The model zoo's unit test of this bundle: the file goes in as the zoo's
# ci/unit_tests/test_cephalometric_xray_landmark_detection.py, which the zoo's premerge runs from the zoo's root
# (python ci/unit_tests/runner.py --b cephalometric_xray_landmark_detection) on models/<bundle>; BUNDLE_ROOT
# names another folder of the unpacked archive (tests/test_zoo_unit.py runs it on a staged archive).
import glob
import os
import shutil
import sys
import tempfile
import unittest

from monai.bundle import ConfigWorkflow

BUNDLE_ROOT = os.environ.get("BUNDLE_ROOT", "models/cephalometric_xray_landmark_detection")
# a training of seconds on a CPU
TINY = {
    "image_size": [64, 64],
    "crop_size": [32, 32],
    "num_queries": 4,
    "batch_size": 2,
    "epochs": 1,
    "epoch_length": 2,
    "val_interval": 1,
    "num_workers": 0,
    "progress_bar": False,
}


class TestCephalometricXrayLandmarkDetection(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp()
        sys.path.insert(0, os.path.abspath(BUNDLE_ROOT))  # the bundle's own code, as its configs import it
        from bundle.data.synthetic import generate_synthetic_2d

        self.datalist = str(
            generate_synthetic_2d(os.path.join(self.work, "data"), n_training=4, n_validation=1, n_test=2, seed=0)
        )

    def tearDown(self):
        sys.path.remove(os.path.abspath(BUNDLE_ROOT))
        shutil.rmtree(self.work)

    def workflow(self, workflow_type, configs, **override):
        """ConfigWorkflow of ``configs`` with every required property (check_properties), run and finalised."""
        workflow = ConfigWorkflow(
            workflow_type=workflow_type,
            config_file=[os.path.join(BUNDLE_ROOT, "configs", c) for c in configs],
            logging_file=os.path.join(BUNDLE_ROOT, "configs", "logging.conf"),
            meta_file=os.path.join(BUNDLE_ROOT, "configs", "metadata.json"),
            bundle_root=BUNDLE_ROOT,
            **override,
        )
        workflow.initialize()
        missing = workflow.check_properties()
        if missing:
            raise ValueError(f"check properties for {configs} ({workflow_type}) failed: {missing}")
        workflow.run()
        workflow.finalize()

    def test_train_and_evaluate(self):
        out = os.path.join(self.work, "train")
        self.workflow("train", ["train.json"], datalist=self.datalist, output_dir=out, **TINY)
        self.assertTrue(os.path.isfile(os.path.join(out, "models", "model.pt")))
        evaluation = os.path.join(self.work, "eval")
        self.workflow(
            "eval",
            ["train.json", "evaluate.json"],
            datalist=self.datalist,
            output_dir=evaluation,
            ckpt_path=os.path.join(out, "models", "model.pt"),
            pipeline="templates",
            **TINY,
        )
        self.assertTrue(os.path.isfile(os.path.join(evaluation, "metrics.json")))

    def test_inference(self):
        out = os.path.join(self.work, "inference")
        images = sorted(glob.glob(os.path.join(os.path.dirname(self.datalist), "images", "test_*.png")))
        self.workflow("inference", ["inference.json"], images=images, output_dir=out, progress_bar=False)
        self.assertTrue(os.path.isfile(os.path.join(out, "predictions.csv")))


if __name__ == "__main__":
    unittest.main()
