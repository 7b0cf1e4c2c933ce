"""MiniMax-H3 for Omni: text, keyframes or references -> 24 fps video with stereo sound."""
